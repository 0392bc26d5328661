"""Tiny random Qwen3 (dense, and dense with tied embeddings) and Qwen3-MoE checkpoints with a char-level
tokenizer, for engine tests; and ``ScriptedEngine``, the scripted rollout engine the tests of what sits
on top of an engine (agent loop, driver, server pool, weight sync, buffer) use as their boundary.

head_dim is 32 because vLLM's CPU attention has no kernel for 16. Everything is fp32 so log-probs can be
compared with a transformers forward to 1e-4.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_sao.rollout.engines.protocol import GenerationResult, SamplingParams, StreamedUpdate

VOCAB = 256
EOS_ID = 1


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "<|endoftext|>": EOS_ID, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def make_tiny_model(root: str | os.PathLike, kind: str, seed: int = 0) -> Path:
    """Save a random ``kind`` ("dense" | "tied" | "moe") model + tokenizer under ``root/kind``; return the
    dir. "tied" is "dense" with tied input/output embeddings (no ``lm_head.weight`` in the checkpoint), as
    SmolLM2 and the small Llama/Qwen models have."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, tie_word_embeddings=kind == "tied", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    if kind == "moe":
        cfg = Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], **common,
        )
        model = Qwen3MoeForCausalLM(cfg)
    elif kind in ("dense", "tied"):
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common))
    else:
        raise ValueError(f"kind must be 'dense', 'tied' or 'moe', got {kind!r}")
    # Random init is small; larger weights make the distribution peaky enough that tests see real changes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    out = Path(root) / kind
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    _tokenizer().save_pretrained(out)
    return out


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The on-disk (HF checkpoint) state dict of a saved tiny model."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A clearly different set of weights with the same names/shapes (what a training step would send)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.float().std().clamp_min(1e-3) * torch.randn(v.shape, generator=g)
            for k, v in state.items()}


@torch.no_grad()
def hf_logprobs(model_dir: str | os.PathLike, state: dict[str, torch.Tensor] | None, prompt: list[int],
                tokens: list[int], temperature: float = 1.0) -> list[float]:
    """Reference log-probs of ``tokens`` after ``prompt`` from a fresh fp32 transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        from megatron_sao.rollout.engines.hf_weights import WeightTargets, apply_update, plan_update

        apply_update(plan_update(WeightTargets(model), [list(state.items())]))
    logits = model(torch.tensor([prompt + tokens])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def lp(i: int) -> float:
    """A distinct, valid log-prob per sampled position, so tests can check where each one landed."""
    return -0.01 * (i + 1)


class ScriptedEngine(StreamedUpdate):
    """A rollout engine (``protocol.RolloutEngine``) with scripted outputs, failures, delays and a recorded
    weight-update surface: the boundary of tests about what drives engines, where a model adds only time.

    Generation: the n-th ``generate`` call answers ``script(n, prefix)`` token ids, each with log-prob
    ``logprob(i)`` (``i``: its position in the reply; a float: that for every token) and the engine's
    ``version``. ``finish`` fixes the finish reason; without it the reply is cut to
    ``sampling.max_new_tokens`` ("length"), and ends "stop" when its last id is a stop id, else "length".
    ``aborts`` makes the first k calls return "abort" with their first two tokens and bumps ``version``
    (as a weight update under the abort policy would). ``delay`` (seconds, or a function of the prefix)
    is slept in every call; then ``fail_on_call`` makes that call raise, and ``down`` (settable) every call
    and health check (a crashed or unreachable server). No ``script``: generate is not expected.

    Weight updates (the streamed methods; ``update_weights`` is the three in one call): ``buckets`` counts
    the current update's buckets, ``updates`` lists the versions finished, ``aborted`` says an update was
    aborted; every push sleeps ``push_delay`` (a hung engine), then raises ``push_error`` when set.
    ``scores``: what ``score(token_ids, start)`` returns (settable); without it the engine has no ``score``
    (it cannot be verified).

    Recorded: ``calls`` (prefix, sampling) of every generate call, ``prompts`` their prefixes, ``answered``
    the replies returned, ``active`` / ``max_active`` the calls in flight now / at most.
    """

    def __init__(self, script: Callable[[int, list[int]], list[int]] | None = None, *, name: str = "scripted",
                 version: int = 0, logprob: Callable[[int], float] | float = lp, finish: str | None = None,
                 aborts: int = 0, fail_on_call: int | None = None,
                 delay: Callable[[list[int]], float] | float = 0.0, down: bool = False, push_delay: float = 0.0,
                 push_error: BaseException | None = None, scores: list[float] | None = None) -> None:
        self.script, self.name, self.version, self.logprob, self.finish = script, name, version, logprob, finish
        self.aborts, self.fail_on_call, self.delay, self.down = aborts, fail_on_call, delay, down
        self.push_delay, self.push_error = push_delay, push_error
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.answered = self.active = self.max_active = 0
        self.buckets, self.aborted, self.paused = 0, False, False
        self.updates: list[int] = []
        self.pending: int | None = None  # the version of the update in progress
        if scores is not None:
            self.scores, self.score = list(scores), self._score

    @property
    def prompts(self) -> list[list[int]]:
        return [p for p, _ in self.calls]

    def _reply(self, ids: list[int], versions: list[int], reason: str) -> GenerationResult:
        lps = [self.logprob(i) if callable(self.logprob) else self.logprob for i in range(len(ids))]
        self.answered += 1
        return GenerationResult(ids, lps, versions, reason)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        n = len(self.calls)
        self.calls.append((list(prompt_ids), sampling))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay(prompt_ids) if callable(self.delay) else self.delay)
            if self.down:
                raise ConnectionError(f"engine at {self.name} refused the connection")
            if self.fail_on_call == n:
                raise ConnectionError("engine went away")
            if self.script is None:
                raise AssertionError(f"{self.name} has no script: generate was not expected")
            ids = list(self.script(n, list(prompt_ids)))
            if n < self.aborts:
                part = ids[:2]
                self.version += 1
                return self._reply(part, [self.version - 1] * len(part), "abort")
            reason = self.finish
            if reason is None:
                reason = "stop"
                if len(ids) > sampling.max_new_tokens:
                    ids, reason = ids[:sampling.max_new_tokens], "length"
                elif not ids or ids[-1] not in sampling.stop_token_ids:
                    reason = "length"
            return self._reply(ids, [self.version] * len(ids), reason)
        finally:
            self.active -= 1

    async def begin_weight_update(self, version: int) -> None:
        self.pending, self.buckets = version, 0

    async def push_weight_bucket(self, bucket) -> None:
        await asyncio.sleep(self.push_delay)
        if self.push_error is not None:
            raise self.push_error
        self.buckets += 1

    async def finish_weight_update(self, version: int) -> None:
        self.version, self.pending = version, None
        self.updates.append(version)

    async def abort_weight_update(self) -> None:
        self.pending, self.aborted = None, True

    async def _score(self, token_ids: list[int], start: int) -> list[float]:
        return list(self.scores)

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def health(self) -> bool:
        return not self.down

    async def close(self) -> None: ...


def answering(formatter, text: str = "=0", **kw) -> ScriptedEngine:
    """A ``ScriptedEngine`` that answers every turn with ``text`` and the formatter's first stop id, finish
    "stop", log-prob -0.5 per token (``=0``: a toy-tool answer, so a toy episode is one turn)."""
    ids = formatter.encode(text) + [formatter.stop_token_ids[0]]
    return ScriptedEngine(lambda n, prefix: ids, logprob=-0.5, finish="stop", **kw)
