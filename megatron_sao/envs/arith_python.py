"""Arithmetic word problems (one or two operations) with the sandboxed Python tool, for small real models.

GSM8K is out of reach for a 135M-parameter chat model (SmolLM2-135M-Instruct earns reward 0 on it),
so this is the same environment as ``math_python`` (tool calls run in the sandbox, ``\\boxed{}`` is
graded by math-verify, reward 1/0) on generated problems a small model can learn to solve with the
tool: "Mia buys 14 boxes of pens. Each box holds 37 pens. How many pens does Mia buy?".

Held-out split by content, not by seed: a problem belongs to ``eval`` iff a hash of its arithmetic
(the kind and the numbers, not the story text) falls in the eval bucket (``EVAL_FRACTION``), else to
``train``. So no held-out computation ever appears in training, whatever the seeds; two generator
seeds alone would collide often on a space this small. The loader takes the split as its
``path_or_spec`` (``env.train_data: train``, ``env.eval_data: eval``).

Turn protocol (the ``math_python`` one, ``MathPythonEnv.step``)::

    system     "You can run Python ... <python>print(3*4)</python> ... \\boxed{12}"
    user       "Mia buys 14 boxes of pens. Each box holds 37 pens. How many pens does Mia buy?"
    assistant  "<python>print(14*37)</python>"        a tool call (or the JSON <tool_call> form)
    tool       "<tool_response>\\n518\\n</tool_response>"
    assistant  "Mia buys \\boxed{518} pens."            graded: reward 1
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from megatron_sao.envs.base import ListTaskSource, Task
from megatron_sao.envs.math_python import MathPythonEnv

ENV_NAME = "arith_python"
SPLITS = ("train", "eval")
EVAL_FRACTION = 0.2  # share of the problem space (by arithmetic) reserved for held-out evaluation
SYSTEM_PROMPT = (
    "Use the Python tool for arithmetic: write <python>print(3*4)</python>, read its output, then "
    "answer as \\boxed{12}."
)

NAMES = ("Mia", "Sam", "Lena", "Omar", "Ava", "Ben", "Zoe", "Raj", "Ella", "Tom", "Nina", "Leo")
ITEMS = ("apples", "pens", "stickers", "marbles", "cookies", "books", "coins", "cards", "stamps", "shells")


@dataclass(frozen=True)
class Kind:
    """One problem shape: how to draw its numbers, its story, and the value it asks for."""

    name: str
    n_ops: int
    draw: Callable[[random.Random], tuple[int, ...]]
    story: str  # str.format fields: name, item, a, b, c
    value: Callable[..., int]
    expression: str  # the computation in Python syntax (demonstrations); str.format fields a, b, c


def _two(rng: random.Random, lo: int, hi: int) -> tuple[int, int]:
    return rng.randint(lo, hi), rng.randint(lo, hi)


def _sub(rng: random.Random) -> tuple[int, int]:
    a, b = _two(rng, 10, 999)
    return (max(a, b), min(a, b)) if a != b else (a + 1, b)


def _div(rng: random.Random) -> tuple[int, int]:
    b, q = rng.randint(2, 12), rng.randint(3, 60)
    return b * q, b


def _mul_sub(rng: random.Random) -> tuple[int, int, int]:
    a, b = rng.randint(2, 30), rng.randint(3, 40)
    return a, b, rng.randint(1, a * b - 1)


def _add_sub(rng: random.Random) -> tuple[int, int, int]:
    a, b = _two(rng, 10, 500)
    return a, b, rng.randint(1, a + b - 1)


KINDS: tuple[Kind, ...] = (
    Kind("add", 1, lambda r: _two(r, 10, 999),
         "{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
         lambda a, b: a + b, "{a}+{b}"),
    Kind("sub", 1, _sub,
         "{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?",
         lambda a, b: a - b, "{a}-{b}"),
    Kind("mul", 1, lambda r: (r.randint(2, 40), r.randint(3, 60)),
         "{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} buy?",
         lambda a, b: a * b, "{a}*{b}"),
    Kind("div", 1, _div,
         "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
         lambda a, b: a // b, "{a}//{b}"),
    Kind("mul_add", 2, lambda r: (r.randint(2, 30), r.randint(3, 40), r.randint(5, 300)),
         "{name} has {c} {item} and buys {a} packs with {b} {item} in each pack. How many {item} does "
         "{name} have now?", lambda a, b, c: c + a * b, "{c}+{a}*{b}"),
    Kind("mul_sub", 2, _mul_sub,
         "{name} buys {a} packs of {item} with {b} {item} in each pack, then gives {c} {item} away. "
         "How many {item} does {name} have left?", lambda a, b, c: a * b - c, "{a}*{b}-{c}"),
    Kind("add_sub", 2, _add_sub,
         "{name} has {a} {item}, gets {b} more and then gives {c} away. How many {item} does {name} "
         "have left?", lambda a, b, c: a + b - c, "{a}+{b}-{c}"),
)
KIND_BY_NAME = {k.name: k for k in KINDS}


def split_of(kind: str, numbers: tuple[int, ...]) -> str:
    """``eval`` or ``train``: a stable hash of the arithmetic (kind + numbers), not of the story.

    hashlib, not ``hash()``: Python salts string hashes per process, and the trainer and a later
    ``sao eval`` must agree on the split.
    """
    key = f"{kind}:{','.join(map(str, numbers))}".encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2 ** 64
    return "eval" if bucket < EVAL_FRACTION else "train"


def _kinds_for(max_ops: int, kinds: list[str] | None) -> list[Kind]:
    if max_ops not in (1, 2):
        raise ValueError(f"arith_python: max_ops must be 1 or 2, got {max_ops}")
    chosen = [k for k in KINDS if k.n_ops <= max_ops]
    if kinds is not None:
        unknown = sorted(set(kinds) - set(KIND_BY_NAME))
        if unknown:
            raise ValueError(f"arith_python: unknown problem kinds {unknown}; known: {sorted(KIND_BY_NAME)}")
        chosen = [k for k in chosen if k.name in kinds]
        if not chosen:
            raise ValueError(f"arith_python: no kind in {kinds} has at most max_ops={max_ops} operations")
    return chosen


def generate_problems(split: str, n: int, seed: int = 0, max_ops: int = 2,
                      kinds: list[str] | None = None) -> list[dict]:
    """``n`` distinct problems of ``split`` (rows: kind, numbers, question, answer, expression)."""
    if split not in SPLITS:
        raise ValueError(f"arith_python: split must be one of {SPLITS} (env.train_data / env.eval_data), got {split!r}")
    if n < 1:
        raise ValueError(f"arith_python: n must be >= 1, got {n}")
    pool = _kinds_for(max_ops, kinds)
    rng = random.Random(f"arith_python/{split}/{seed}")
    rows, seen = [], set()
    for _ in range(200 * n):  # rejection: other split, duplicates
        kind = rng.choice(pool)
        numbers = kind.draw(rng)
        if (kind.name, numbers) in seen or split_of(kind.name, numbers) != split:
            continue
        seen.add((kind.name, numbers))
        fields = dict(zip("abc", numbers), name=rng.choice(NAMES), item=rng.choice(ITEMS))
        rows.append({"kind": kind.name, "numbers": numbers, "question": kind.story.format(**fields),
                     "answer": kind.value(*numbers), "expression": kind.expression.format(**fields)})
        if len(rows) == n:
            return rows
    raise ValueError(f"arith_python: could not draw {n} distinct {split} problems (kinds {[k.name for k in pool]})")


def solved_conversation(row: dict, numbers: tuple[int, ...] | None = None, final: int | None = None) -> list[dict]:
    """User / assistant / tool / assistant messages of ``row`` solved with the tool.

    ``numbers`` replaces the operands the call uses (a flawed demonstration: a mistyped number) and
    ``final`` the boxed value (a wrongly copied result); the tool message is always what the real
    tool prints for the call that was made, so a flawed demonstration stays consistent.
    """
    from megatron_sao.envs.tool_calls import format_tool_response

    kind = KIND_BY_NAME[row["kind"]]
    numbers = tuple(row["numbers"]) if numbers is None else numbers
    result = kind.value(*numbers)
    expression = kind.expression.format(**dict(zip("abc", numbers)))
    return [{"role": "user", "content": row["question"]},
            {"role": "assistant", "content": f"<python>print({expression})</python>"},
            {"role": "tool", "content": format_tool_response(str(result))},
            {"role": "assistant", "content": f"The answer is \\boxed{{{result if final is None else final}}}."}]


def load_arith_tasks(path_or_spec: str | None = "train", n: int = 2000, seed: int = 0, max_ops: int = 2,
                     kinds: list[str] | None = None, system_prompt: str = SYSTEM_PROMPT) -> ListTaskSource:
    """Tasks of one split (``path_or_spec`` = ``train`` | ``eval``), identical for identical arguments."""
    split = path_or_spec or "train"
    rows = generate_problems(split, n, seed, max_ops, kinds)
    return ListTaskSource([
        Task(prompt_id=f"arith/{split}/{seed}/{i}", env=ENV_NAME, answer=str(r["answer"]),
             messages=[{"role": "system", "content": system_prompt}, {"role": "user", "content": r["question"]}],
             meta={"kind": r["kind"], "numbers": list(r["numbers"]), "expression": r["expression"]})
        for i, r in enumerate(rows)])


def reference_actions(task: Task) -> list[str]:
    """The actions of a correct episode (the demonstrations' format): the tool call, then the answer."""
    return [f"<python>print({task.meta['expression']})</python>", f"The answer is \\boxed{{{task.answer}}}."]


def _perturb(rng: random.Random, value: int) -> int:
    """``value`` with one digit changed (never a leading zero): a plausible typo, a different number."""
    s = str(abs(value))
    i = rng.randrange(len(s))
    t = s[:i] + rng.choice([d for d in "0123456789" if d != s[i] and not (i == 0 and d == "0")]) + s[i + 1:]
    return -int(t) if value < 0 else int(t)


def make_demonstrations(n: int, seed: int = 0, error_rate: float = 0.0, max_ops: int = 2,
                        kinds: list[str] | None = None, system_prompt: str = SYSTEM_PROMPT) -> list[list[dict]]:
    """``n`` solved *training* problems in the tool format (the SFT stage), a share of them flawed.

    With probability ``error_rate`` a demonstration has one mistake: an operand copied wrongly into
    the tool call (two cases in three) or the tool's result copied wrongly into the answer. The
    policy SFT produces then makes such mistakes too, and RL has something to fix: the paper's
    setting of an imperfect SFT start.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"arith_python: error_rate must be in [0, 1], got {error_rate}")
    rng = random.Random(f"arith_python/demos/{seed}")
    demos = []
    for r in generate_problems("train", n, seed + 7_919, max_ops, kinds):
        numbers, final = None, None
        if rng.random() < error_rate:
            if rng.random() < 2 / 3:
                numbers = list(r["numbers"])
                j = rng.randrange(len(numbers))
                numbers[j] = _perturb(rng, numbers[j])
                numbers = tuple(numbers) if KIND_BY_NAME[r["kind"]].value(*numbers) >= 0 else None
            if numbers is None:
                final = _perturb(rng, r["answer"])
        demos.append([{"role": "system", "content": system_prompt}, *solved_conversation(r, numbers, final)])
    return demos


@dataclass
class ArithPythonEnv(MathPythonEnv):
    """``MathPythonEnv`` under its own name, with a turn budget that fits a one- or two-step problem."""

    max_tool_calls: int = 4
    name: str = ENV_NAME
