"""A small torch rollout engine: continuous batching over a transformers causal LM, on one worker thread.

Why it exists: tests, CPU demos and a reference for the log-prob semantics every backend must match.
It is not meant to be fast on large models (vLLM is).

Design. One dedicated thread owns the model; the asyncio side only enqueues work and awaits futures,
so the event loop stays responsive. The thread loops: run queued commands (weight update, pause,
abort), admit pending requests up to ``max_batch_size`` (each is prefilled alone, no padding), then do
one decode step for every active request together: per-request KV caches are left-padded into one
batch cache with an attention mask and explicit position ids, so padding never changes a result.
Commands run *between* steps, which is what makes pause/update/resume atomic with respect to decoding.

Versions: every token records the version of the weights whose forward produced the logits it was
sampled from. With ``inflight_policy="keep"`` a request admitted before an update keeps its KV cache
(computed by the old weights, as in vLLM's pause(mode="keep")) and continues under the new version.
With ``"abort"`` the update first ends all active requests with ``finish_reason="abort"`` and their
partial tokens; requests still waiting for admission simply run under the new weights.

Weight updates are streamed (``begin_weight_update`` / ``push_weight_bucket`` / ``finish_weight_update``):
each pushed bucket is validated and copied into a staging area at once (so the sender can free it),
generation goes on with the old weights meanwhile, and ``finish`` swaps everything in between two
decoding steps: an update is applied all or nothing, and a bad bucket leaves the model untouched.

A model that is not a transformers model (e.g. a wrapped Megatron module) can be used with
``use_kv_cache=False``: it is called as ``model(input_ids[1, T])`` and must return logits [1, T, V]
(or an object with ``.logits``); each step recomputes the whole sequence.

Device: every tensor the engine feeds the model (ids, masks, positions, score indices) is made on
``self.device`` (``EngineConfig.device``; default: where the model's parameters are), so the engine
generates on a GPU as on the CPU. Sampling keeps its per-request generator on the host and moves one
uniform draw per token to the logits' device (``rollout/engines/sampling.py``): the same seed samples the same
ids whatever the device.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_sao.rollout.engines.hf_weights import WeightTargets, apply_update, plan_update
from megatron_sao.rollout.engines.kinds import INFLIGHT_POLICIES
from megatron_sao.rollout.engines.protocol import (
    EngineConfig,
    GenerationResult,
    InflightPolicy,
    SamplingParams,
    StreamedUpdate,
    WeightBucket,
)
from megatron_sao.rollout.engines.sampling import sample_token


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, H, L, D]
    next_logits: torch.Tensor | None = None  # [V], logits for the next token
    logits_version: int = 0  # weights version that produced next_logits
    cancelled: bool = False
    routes: list[torch.Tensor] = field(default_factory=list)  # return_routes: [n, layers, topk] chunks

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


def _model_device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _logits_of(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits  # type: ignore[attr-defined]


def _routers(model: nn.Module) -> list[nn.Module]:
    """transformers' top-k router modules in layer order (Qwen3-MoE: ``Qwen3MoeTopKRouter``, which
    returns (router_logits, router_scores, router_indices)); [] for a dense model."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class HFEngine(StreamedUpdate):
    """``RolloutEngine`` over any causal LM ``nn.Module``; see the module docstring for semantics."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_model_len: int,
        inflight_policy: InflightPolicy = "keep",
        max_batch_size: int = 8,
        eos_token_ids: Iterable[int] = (),
        use_kv_cache: bool | None = None,
        seed: int = 0,
        name: str = "hf",
        device: str | torch.device | None = None,
    ) -> None:
        if inflight_policy not in INFLIGHT_POLICIES:
            raise ValueError(f"HFEngine inflight_policy must be 'keep' or 'abort', got {inflight_policy!r}")
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.name = name
        self.version = 0
        self.max_model_len = max_model_len
        self.inflight_policy: InflightPolicy = inflight_policy
        self.max_batch_size = max_batch_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if use_kv_cache is None:
            from transformers import PreTrainedModel

            use_kv_cache = isinstance(model, PreTrainedModel)
        self.use_kv_cache = use_kv_cache
        self._targets = WeightTargets(model)
        # Routes are what the routers chose, read by a forward hook on each of them (their own
        # top-k indices, not a recomputation), while a forward that wants them runs.
        hf_cfg = getattr(model, "config", None)
        self.num_experts = int(getattr(hf_cfg, "num_experts", 0) or 0)  # 0: dense, no routes to return
        self._captured: list[torch.Tensor] | None = None
        self._routers = _routers(model)
        for router in self._routers:
            router.register_forward_hook(self._capture_route)
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._commands: deque[tuple[Callable[[], object], asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._paused = False
        self._closed = False
        self.last_update_bytes = 0
        self._staged: list | None = None  # weight update in progress: (target, private copy) pairs
        self._staged_names: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, cfg: EngineConfig) -> "HFEngine":
        """Load ``cfg.model_path`` with transformers (eager-free sdpa attention, ``cfg.dtype``)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_cfg = AutoConfig.from_pretrained(cfg.model_path)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=cfg.torch_dtype).to(cfg.device)
        eos = hf_cfg.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model,
            max_model_len=cfg.max_model_len,
            inflight_policy=cfg.inflight_policy,
            max_batch_size=cfg.max_batch_size,
            eos_token_ids=eos_ids,
            seed=cfg.seed,
            name=f"hf:{cfg.model_path}",
            device=cfg.device,
        )

    # ------------------------------------------------------------------ async API (event loop side)
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        if not prompt_ids:
            raise ValueError(f"{self.name}: generate got an empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"{self.name}: prompt has {len(prompt_ids)} tokens, max_model_len is {self.max_model_len}")
        if sampling.return_routes:
            if not self._routers or not self.num_experts or not self.use_kv_cache:
                raise ValueError(f"{self.name}: return_routes needs a transformers MoE model (num_experts in its "
                                 "config, KV-cache decoding); this model has none")
            if sampling.routes_start >= len(prompt_ids):
                raise ValueError(f"{self.name}: routes_start {sampling.routes_start} is not inside the prompt "
                                 f"of {len(prompt_ids)} tokens")
        loop = asyncio.get_running_loop()
        seed = sampling.seed if sampling.seed is not None else self._rng.randrange(2**63)
        req = _Request(list(prompt_ids), sampling, loop.create_future(), loop, torch.Generator().manual_seed(seed))
        with self._cond:
            self._check_open()
            self._pending.append(req)
            self._cond.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True  # the worker drops it at the next step
            raise

    async def begin_weight_update(self, version: int) -> None:
        if self._staged is not None:
            raise RuntimeError(f"{self.name}: begin_weight_update v{version} while an update is in progress")
        self._staged, self._staged_names = [], set()

    async def push_weight_bucket(self, bucket: WeightBucket) -> None:
        """Validate one bucket against the model and stage a private copy of it."""
        if self._staged is None:
            raise RuntimeError(f"{self.name}: push_weight_bucket outside begin/finish_weight_update")
        plan = plan_update(self._targets, [bucket], owner=self.name, seen=self._staged_names)
        self._staged.extend((target, t.detach().to(target.param.device, copy=True)) for target, t in plan)

    async def finish_weight_update(self, version: int) -> None:
        """Swap the staged tensors in between two steps and label what follows ``version``."""
        if self._staged is None:
            raise RuntimeError(f"{self.name}: finish_weight_update without begin_weight_update")
        plan, self._staged = self._staged, None

        def _apply() -> None:
            if self.inflight_policy == "abort":
                self._finish_all_active("abort")
            self.last_update_bytes = apply_update(plan)
            self.version = version

        await self._command(_apply)

    async def abort_weight_update(self) -> None:
        self._staged = None

    async def pause(self) -> None:
        """Stop decoding after the current step; requests stay in flight (KV kept) until resume."""
        await self._command(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    async def abort_all(self) -> None:
        """End every active request now with finish_reason "abort" and its partial tokens."""
        await self._command(lambda: self._finish_all_active("abort"))

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._closed

    async def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join, 30.0)
        for req in list(self._pending) + self._active:
            self._resolve(req, exc=RuntimeError(f"{self.name}: engine closed"))
        self._pending.clear()
        self._active.clear()

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (T=1) of ``token_ids[start:]`` under the current weights, for weight-sync checks."""
        return (await self._command(lambda: self._score(token_ids, start, routes=False)))[0]

    async def score_routed(self, token_ids: list[int], start: int) -> tuple[list[float], torch.Tensor]:
        """``score`` and the experts the routers chose for every token of ``token_ids`` ([T, layers, topk]),
        for the weight-sync check under routing replay (the trainer's reference forward replays them)."""
        if not self._routers or not self.num_experts:
            raise ValueError(f"{self.name}: score_routed needs a transformers MoE model (num_experts in its config)")
        return await self._command(lambda: self._score(token_ids, start, routes=True))

    def _score(self, token_ids: list[int], start: int, routes: bool) -> tuple[list[float], torch.Tensor | None]:
        with torch.no_grad(), self._recording_routes(routes) as routed:
            logits = _logits_of(self.model(self._ids([token_ids])))[0].float()
        lp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
        return lp.gather(-1, self._ids(token_ids[start:])[:, None])[:, 0].tolist(), routed() if routes else None

    # ------------------------------------------------------------------ worker thread
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: engine is closed")

    async def _command(self, fn: Callable[[], object]) -> object:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            self._check_open()
            self._commands.append((fn, fut, loop))
            self._cond.notify()
        return await fut

    def _resolve(self, req: _Request, result: GenerationResult | None = None, exc: BaseException | None = None) -> None:
        def _set() -> None:
            if req.future.done():
                return
            if exc is not None:
                req.future.set_exception(exc)
            else:
                req.future.set_result(result)

        try:
            req.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the caller's loop is gone; nobody is waiting
            pass

    def _finish(self, req: _Request, reason: str) -> None:
        req.kv = req.next_logits = None
        routes = torch.cat(req.routes) if req.sampling.return_routes else None
        self._resolve(req, GenerationResult(req.token_ids, req.logprobs, req.versions, reason, routes))

    def _finish_all_active(self, reason: str) -> None:
        for req in self._active:
            self._finish(req, reason)
        self._active = []

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._commands and (
                    self._paused or (not self._pending and not self._active)
                ):
                    self._cond.wait()
                if self._closed:
                    return
                commands = list(self._commands)
                self._commands.clear()
                admitted: list[_Request] = []
                if not self._paused:
                    while self._pending and len(self._active) + len(admitted) < self.max_batch_size:
                        admitted.append(self._pending.popleft())
            for fn, fut, loop in commands:
                try:
                    res, err = fn(), None
                except Exception as e:  # reported to the caller of the command
                    res, err = None, e
                loop.call_soon_threadsafe(
                    lambda f=fut, r=res, e=err: None if f.done() else (f.set_exception(e) if e else f.set_result(r))
                )
            if self._paused:
                continue
            # Read each request's ``cancelled`` flag once: the event loop may set it at any moment, and a
            # request that joins the batch must also have been prefilled.
            batch = [r for r in self._active if not r.cancelled]
            try:
                for req in admitted:
                    if not req.cancelled:
                        self._prefill(req)
                        batch.append(req)
                self._active = self._step(batch)
            except Exception as e:  # a failed forward fails the requests it touched, not the engine
                for req in batch:
                    self._resolve(req, exc=RuntimeError(f"{self.name}: generation failed: {e!r}"))
                self._active = []

    def _capture_route(self, module: nn.Module, args, output) -> None:
        if self._captured is not None:
            self._captured.append(output[2].detach())  # router_indices [tokens, topk]

    @contextmanager
    def _recording_routes(self, on: bool):
        """Inside: the routers' choices are recorded; the yielded function returns them as
        [tokens, layers, topk] in the smallest dtype holding the expert count."""
        from megatron_sao.trajectory import route_dtype

        self._captured = [] if on else None

        def routes() -> torch.Tensor:
            if len(captured) != len(self._routers):
                raise RuntimeError(f"{self.name}: {len(captured)} router calls in one forward, expected "
                                   f"{len(self._routers)} (one per MoE layer)")
            return torch.stack(captured, dim=1).to("cpu", route_dtype(self.num_experts))

        captured = self._captured
        try:
            yield routes
        finally:
            self._captured = None

    def _ids(self, data) -> torch.Tensor:
        """Token ids / positions (nested lists of ints) on the engine's device."""
        return torch.tensor(data, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def _prefill(self, req: _Request) -> None:
        ids = self._ids([req.prompt_ids])
        if self.use_kv_cache:
            want = req.sampling.return_routes
            with self._recording_routes(want) as routes:
                out = self.model(input_ids=ids, use_cache=True)
            req.kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            if want:  # the prompt's routes from routes_start on (the tokens before were covered earlier)
                req.routes.append(routes()[req.sampling.routes_start:])
        else:
            out = self.model(ids)
        req.next_logits = _logits_of(out)[0, -1]
        req.logits_version = self.version

    @torch.no_grad()
    def _step(self, batch: list[_Request]) -> list[_Request]:
        """Sample one token for each request, finish the done ones, run one forward for the rest."""
        running: list[_Request] = []
        for req in batch:
            token, logprob = sample_token(req.next_logits, req.sampling, req.generator)
            req.token_ids.append(token)
            req.logprobs.append(logprob)
            req.versions.append(req.logits_version)
            if token in req.sampling.stop_token_ids or token in self.eos_token_ids:
                self._finish(req, "stop")
            elif len(req.token_ids) >= req.sampling.max_new_tokens or req.seq_len >= self.max_model_len:
                self._finish(req, "length")
            else:
                running.append(req)
        if running:
            if self.use_kv_cache:
                self._decode_batched(running)
            else:
                for req in running:
                    req.next_logits = _logits_of(self.model(self._ids([req.prompt_ids + req.token_ids])))[0, -1]
                    req.logits_version = self.version
        return running

    def _decode_batched(self, reqs: list[_Request]) -> None:
        """One decode step for all ``reqs``: left-pad their caches into one batch, then split back."""
        from transformers import DynamicCache

        lens = [r.seq_len - 1 for r in reqs]  # cached tokens; the newest token is the input
        width = max(lens)
        n_layers = len(reqs[0].kv)
        layers = []
        for i in range(n_layers):
            ks, vs = [], []
            for r, n in zip(reqs, lens):
                k, v = r.kv[i]
                pad = width - n
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
            layers.append((torch.cat(ks), torch.cat(vs)))
        mask = self._ids([[0] * (width - n) + [1] * (n + 1) for n in lens])
        want = any(r.sampling.return_routes for r in reqs)
        with self._recording_routes(want) as routes:
            out = self.model(
                input_ids=self._ids([[r.token_ids[-1]] for r in reqs]),
                attention_mask=mask,
                position_ids=self._ids([[n] for n in lens]),
                past_key_values=DynamicCache(layers),
                use_cache=True,
            )
        if want:  # one routed token per request (the router sees [batch * 1] rows): the token this step fed
            step_routes = routes()
            for b, r in enumerate(reqs):
                if r.sampling.return_routes:
                    r.routes.append(step_routes[b : b + 1])
        logits = _logits_of(out)[:, -1]
        new_layers = out.past_key_values.layers
        for b, (r, n) in enumerate(zip(reqs, lens)):
            start = width - n
            r.kv = [(layer.keys[b : b + 1, :, start:], layer.values[b : b + 1, :, start:]) for layer in new_layers]
            r.next_logits = logits[b]
            r.logits_version = self.version
