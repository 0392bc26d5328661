"""Generated SWE tasks (SWE-smith style): a small repository with one injected bug and the tests it breaks.

A task is one module of ``library.py`` as a repository, ``sao_lib/<module>.py`` plus ``tests/``, with one
function mutated by one operator at one site: a comparison flipped (``<`` / ``<=``, ``>`` / ``>=``, ``==`` /
``!=``), an arithmetic operator swapped (``+`` / ``-``, ``*`` -> ``+``, ``//`` / ``/``, ``%`` -> ``//``), an
integer constant moved by one, ``and`` / ``or`` swapped. Every candidate is run on the host against the
module's cases (our own code, under a line budget so a mutation that loops forever is dropped): the
cases it breaks are FAIL_TO_PASS, the module's other cases PASS_TO_PASS, and a candidate that breaks
none is no task. Like SWE-bench, the repository's visible tests are the PASS_TO_PASS ones; the hidden
test file, copied over ``tests/`` only when grading, has every case. The problem statement is a bug
report of the first broken case ("``clamp(5, 0, 3)`` returns ``5``; expected ``3``").

Held-out split by content: a task belongs to ``eval`` iff a hash of (module, function, operator, site)
falls in the eval bucket (``EVAL_FRACTION``), so the same bug never appears in both splits.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import sys
from dataclasses import dataclass

from megatron_sao.envs.swe.library import MODULES, Function, Module

PACKAGE = "sao_lib"
SPLITS = ("train", "eval")
EVAL_FRACTION = 0.25
_LINE_BUDGET = 20_000  # traced lines per case: past it the mutation is taken to hang
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Div, ast.Div: ast.FloorDiv,
        ast.Mod: ast.FloorDiv}
_BOOL = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Bug:
    module: str
    function: str
    operator: str  # compare / binop / constant_up / constant_down / negation / boolop
    site: int  # which eligible node of that kind, in walk order
    source: str  # the mutated function


@dataclass(frozen=True)
class GeneratedTask:
    task_id: str
    bug: Bug
    files: dict[str, str]  # the repository the agent gets
    hidden_tests: dict[str, str]  # copied over the repository before grading
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    problem_statement: str


def _sites(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in _CMP:
            out.append(("compare", node))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            out.append(("binop", node))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out += [("constant_up", node), ("constant_down", node)]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            out.append(("negation", node))
        elif isinstance(node, ast.BoolOp) and type(node.op) in _BOOL:
            out.append(("boolop", node))
    return out


def _mutate(node: ast.AST, operator: str) -> None:
    if operator == "compare":
        node.ops[0] = _CMP[type(node.ops[0])]()
    elif operator == "binop":
        node.op = _BIN[type(node.op)]()
    elif operator == "constant_up":
        node.value += 1
    elif operator == "constant_down":
        node.value -= 1
    elif operator == "negation":
        node.op = ast.UAdd()
    else:
        node.op = _BOOL[type(node.op)]()


def canonical(source: str) -> str:
    """The form every function takes in a repository (ast.unparse), so a bug is a one-site diff."""
    return ast.unparse(ast.parse(source)) + "\n"


def mutations(fn: Function) -> list[Bug]:
    """Every one-site mutation of ``fn`` (module docstring), unevaluated."""
    tree = ast.parse(fn.source)
    counts: dict[str, int] = {}
    bugs = []
    for i, (operator, _) in enumerate(_sites(tree)):
        mutant = copy.deepcopy(tree)
        _mutate(_sites(mutant)[i][1], operator)
        site = counts.get(operator, 0)
        counts[operator] = site + 1
        bugs.append(Bug("", fn.name, operator, site, ast.unparse(mutant) + "\n"))
    return bugs


class _Hang(Exception):
    pass


def _call_bounded(fn, args: tuple):
    budget = [_LINE_BUDGET]

    def tracer(frame, event, arg):
        budget[0] -= 1
        if budget[0] < 0:
            raise _Hang()
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn(*copy.deepcopy(args))
    finally:
        sys.settrace(old)


def _broken_cases(source: str, fn: Function) -> list[tuple[int, str]] | None:
    """(case index, what the mutant did) of every case it breaks; None when it hangs on one."""
    ns: dict = {}
    exec(compile(source, f"<{fn.name}>", "exec"), ns)
    out = []
    for k, (args, expected) in enumerate(fn.cases):
        try:
            got = _call_bounded(ns[fn.name], args)
        except _Hang:
            return None
        except Exception as e:
            out.append((k, f"raises {type(e).__name__}: {e}"))
            continue
        if got != expected:  # what the test's assertEqual checks
            out.append((k, f"returns {got!r}"))
    return out


def _call_text(fn: Function, args: tuple) -> str:
    return f"{fn.name}({', '.join(repr(a) for a in args)})"


def _test_file(module: Module, keep: set[str] | None) -> str:
    lines = ["import unittest", "", f"from {PACKAGE}.{module.name} import *  # noqa: F403", "", "",
             f"class Test{module.name.title()}(unittest.TestCase):"]
    for fn in module.functions:
        for k, (args, expected) in enumerate(fn.cases):
            name = f"test_{fn.name}_{k}"
            if keep is not None and name not in keep:
                continue
            lines += [f"    def {name}(self):", f"        self.assertEqual({_call_text(fn, args)}, {expected!r})", ""]
    return "\n".join(lines).rstrip() + "\n"


def split_of(bug: Bug) -> str:
    key = f"{bug.module}/{bug.function}/{bug.operator}/{bug.site}".encode()
    bucket = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2**64
    return "eval" if bucket < EVAL_FRACTION else "train"


@functools.lru_cache(maxsize=None)
def generate(split: str) -> tuple[GeneratedTask, ...]:
    """Every task of ``split`` ("train" / "eval"), in a fixed order (about a second: cached)."""
    if split not in SPLITS:
        raise ValueError(f"generated SWE tasks: split must be one of {SPLITS}, got {split!r}")
    tasks = []
    for module in MODULES:
        test_cls = f"tests.test_{module.name}.Test{module.name.title()}"
        all_ids = [f"{test_cls}.test_{fn.name}_{k}" for fn in module.functions for k in range(len(fn.cases))]
        for fn in module.functions:
            for bug in mutations(fn):
                bug = Bug(module.name, bug.function, bug.operator, bug.site, bug.source)
                if split_of(bug) != split:
                    continue
                broken = _broken_cases(bug.source, fn)
                if not broken:
                    continue  # hangs, or breaks nothing the tests see
                f2p = [f"{test_cls}.test_{fn.name}_{k}" for k, _ in broken]
                p2p = [t for t in all_ids if t not in f2p]
                k0, did = broken[0]
                args, expected = fn.cases[k0]
                statement = (f"Bug report for the `{PACKAGE}` package: `{_call_text(fn, args)}` {did}, but it should "
                             f"return {expected!r}. Fix the bug in `{PACKAGE}/{module.name}.py`. The tests run with "
                             "`python3 -m unittest`.")
                source = "\n\n".join(bug.source if f is fn else canonical(f.source) for f in module.functions)
                visible = {t.rsplit(".", 1)[1] for t in p2p}
                files = {f"{PACKAGE}/__init__.py": "", f"{PACKAGE}/{module.name}.py": source, "tests/__init__.py": "",
                         f"tests/test_{module.name}.py": _test_file(module, visible)}
                hidden = {f"tests/test_{module.name}.py": _test_file(module, None)}
                task_id = f"{module.name}.{fn.name}.{bug.operator}{bug.site}"
                tasks.append(GeneratedTask(task_id, bug, files, hidden, f2p, p2p, statement))
    return tuple(tasks)
