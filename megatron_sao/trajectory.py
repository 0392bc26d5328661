"""The Trajectory: the one contract between rollout and training.

One prompt gives one trajectory (single rollout). It holds the token ids in order (prompt, actions,
observations), which of them the policy sampled, the log-prob and policy version recorded by the
rollout engine for each sampled token, the turn spans, and one scalar reward that training places on
the last action token. Nothing on the training side knows which engine or environment produced it.

Invariants (checked by `Trajectory.validate`, which the constructor calls):
- tokens, action_mask, rollout_logprobs and versions have the same length T >= 1;
- rollout_logprobs == 0 and versions == -1 exactly where action_mask is False (an observation token
  never carries a log-prob: it was not sampled);
- rollout_logprobs <= 0 and finite, versions >= 0 on action tokens;
- the turn spans tile [0, T) in order, and a span is "action" exactly where the mask is True;
- a terminated or truncated trajectory has at least one action token (its reward needs a home);
- status "truncated" needs `bootstrap`: "critic" (the trainer bootstraps from the critic's value of
  the final state), "critic_before_stop" (from its value of the state the final stop token was
  sampled in: the last token must be an action token with one before it), or a float given by the
  producer; other statuses must not set it;
- a "failed" trajectory has reward 0 and an `error`; the trainer excludes it from training and counts it;
- `routed_experts` (MoE routing replay, optional) is an integer tensor [R, layers, topk] of the experts
  the engine routed tokens 0..R-1 to, R in [last action index, T - 1]: an engine never forwards the
  last token it samples (its route would come from the next turn's prefill, and there is none), and
  observation tokens after the last action are never forwarded; neither changes a scored log-prob.
  Ids are >= 0 and distinct within a token's top-k; stored in the smallest dtype that holds the
  expert count (`route_dtype`).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch

from megatron_sao.errors import UserError

Status = Literal["terminated", "truncated", "failed"]
SpanKind = Literal["prompt", "action", "observation"]
STATUSES: tuple[str, ...] = ("terminated", "truncated", "failed")
# A truncated trajectory's bootstrap from the critic: the state after its last token, or the state its
# final stop token was sampled in (when the observation that should follow does not fit).
BOOTSTRAP_FROM_CRITIC: tuple[str, ...] = ("critic", "critic_before_stop")
SPAN_KINDS: tuple[str, ...] = ("prompt", "action", "observation")
FORMAT_VERSION = 2  # 2: optional routed_experts (files of version 1 have none and still load)
_ROUTE_DTYPES = (torch.uint8, torch.int16, torch.int32)


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding expert ids 0..num_experts-1 (uint8 up to 256 experts)."""
    if num_experts < 1:
        raise ValueError(f"route_dtype: num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 32768 else torch.int32


class TrajectoryError(ValueError):
    """A trajectory that breaks the contract. The message names the field and the trajectory."""


@dataclass(frozen=True)
class Span:
    start: int
    end: int  # exclusive
    kind: str  # one of SPAN_KINDS


@dataclass(eq=False)
class Trajectory:
    tokens: torch.Tensor  # int64 [T]
    action_mask: torch.Tensor  # bool [T]
    rollout_logprobs: torch.Tensor  # float32 [T], 0 off the action mask
    versions: torch.Tensor  # int64 [T], -1 off the action mask
    spans: list[Span]
    reward: float
    status: str
    bootstrap: float | str | None = None  # truncated only: one of BOOTSTRAP_FROM_CRITIC or a value
    prompt_id: str = ""
    env: str = ""
    traj_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None  # [R, layers, topk] (module docstring), MoE replay only

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.int64).reshape(-1)
        self.action_mask = torch.as_tensor(self.action_mask, dtype=torch.bool).reshape(-1)
        self.rollout_logprobs = torch.as_tensor(self.rollout_logprobs, dtype=torch.float32).reshape(-1)
        self.versions = torch.as_tensor(self.versions, dtype=torch.int64).reshape(-1)
        self.spans = [s if isinstance(s, Span) else Span(*s) for s in self.spans]
        self.reward = float(self.reward)
        if self.routed_experts is not None:
            self.routed_experts = torch.as_tensor(self.routed_experts)
        self.validate()

    # ------------------------------------------------------------------ validation
    def _fail(self, msg: str) -> None:
        raise TrajectoryError(f"trajectory {self.traj_id} (prompt {self.prompt_id!r}): {msg}")

    def validate(self) -> None:
        T = self.tokens.numel()
        if T == 0:
            self._fail("tokens is empty")
        for name in ("action_mask", "rollout_logprobs", "versions"):
            n = getattr(self, name).numel()
            if n != T:
                self._fail(f"{name} has length {n}, tokens has length {T}")
        if (self.tokens < 0).any():
            self._fail("tokens contains negative ids")
        off = ~self.action_mask
        if (self.rollout_logprobs[off] != 0).any():
            n = int((self.rollout_logprobs[off] != 0).sum())
            self._fail(f"rollout_logprobs is nonzero on {n} non-action (observation/prompt) token(s)")
        if (self.versions[off] != -1).any():
            self._fail("versions must be -1 on non-action tokens")
        on = self.action_mask
        lp = self.rollout_logprobs[on]
        if not torch.isfinite(lp).all() or (lp > 0).any():
            self._fail("rollout_logprobs on action tokens must be finite and <= 0")
        if (self.versions[on] < 0).any():
            self._fail("versions on action tokens must be >= 0")
        self._validate_spans(T)
        if self.status not in STATUSES:
            self._fail(f"status {self.status!r} is not one of {STATUSES}")
        if not math.isfinite(self.reward):
            self._fail(f"reward {self.reward} is not finite")
        if self.status in ("terminated", "truncated") and not bool(on.any()):
            self._fail(f"a {self.status} trajectory needs at least one action token to carry its reward")
        if self.status == "truncated":
            if self.bootstrap is None:
                self._fail("a truncated trajectory needs a bootstrap ('critic' or a value)")
            if isinstance(self.bootstrap, str) and self.bootstrap not in BOOTSTRAP_FROM_CRITIC:
                self._fail(f"bootstrap {self.bootstrap!r} must be one of {BOOTSTRAP_FROM_CRITIC} or a float")
            if self.bootstrap == "critic_before_stop" and (T < 2 or not bool(self.action_mask[-1])):
                self._fail("bootstrap 'critic_before_stop' needs the last token to be a sampled one, "
                           "with a token before it")
        elif self.bootstrap is not None:
            self._fail(f"bootstrap is only allowed on truncated trajectories (status {self.status})")
        if self.status == "failed":
            if not self.error:
                self._fail("a failed trajectory must record its error")
            if self.reward != 0.0:
                self._fail("a failed trajectory must have reward 0")
        if self.routed_experts is not None:
            self._validate_routes(T)

    def _validate_routes(self, T: int) -> None:
        r = self.routed_experts
        if r.dtype not in _ROUTE_DTYPES or r.dim() != 3 or r.shape[1] < 1 or r.shape[2] < 1:
            self._fail(f"routed_experts must be a [R, layers, topk] tensor of {[str(d) for d in _ROUTE_DTYPES]}, "
                       f"got {r.dtype} {tuple(r.shape)}")
        n = r.shape[0]
        if self.status != "failed" and not (max(self.last_action_index, 0) <= n <= T - 1):
            self._fail(f"routed_experts covers {n} token(s); it must cover every token before the last action "
                       f"token ({self.last_action_index}) and at most T - 1 = {T - 1} (the last token is never "
                       "forwarded by an engine)")
        if n > T - 1:
            self._fail(f"routed_experts covers {n} token(s), more than T - 1 = {T - 1}")
        if n and r.shape[2] > 1:
            ids = r.to(torch.int64)
            if (ids < 0).any():
                self._fail("routed_experts has negative expert ids")
            srt = ids.sort(dim=-1).values
            if (srt[..., 1:] == srt[..., :-1]).any():
                self._fail("routed_experts names one expert twice in a token's top-k")
        elif n and (r.to(torch.int64) < 0).any():
            self._fail("routed_experts has negative expert ids")

    def routes_problem(self, layers: int, topk: int, num_experts: int) -> str | None:
        """Why these routes cannot be replayed by an MoE of ``layers`` layers routing top-``topk`` over
        ``num_experts`` experts (a buffer file from another model), or None (they can, or there are none)."""
        r = self.routed_experts
        if r is None:
            return None
        if tuple(r.shape[1:]) != (layers, topk):
            return (f"its routes are [tokens, {r.shape[1]}, {r.shape[2]}] (layers, topk); this actor routes "
                    f"[tokens, {layers}, {topk}]")
        if r.numel() and int(r.max()) >= num_experts:
            return f"its routes name expert {int(r.max())}; this actor has {num_experts} experts"
        return None

    def _validate_spans(self, T: int) -> None:
        if not self.spans:
            self._fail("spans is empty")
        pos = 0
        for i, s in enumerate(self.spans):
            if s.kind not in SPAN_KINDS:
                self._fail(f"span {i} kind {s.kind!r} is not one of {SPAN_KINDS}")
            if s.start != pos or s.end <= s.start:
                self._fail(f"span {i} ({s.start}, {s.end}) does not continue at {pos}: spans must tile the tokens")
            seg = self.action_mask[s.start:s.end]
            if s.kind == "action" and not bool(seg.all()):
                self._fail(f"span {i} is an action span but covers non-action tokens")
            if s.kind != "action" and bool(seg.any()):
                self._fail(f"span {i} is a {s.kind} span but covers action tokens")
            pos = s.end
        if pos != T:
            self._fail(f"spans end at {pos}, tokens has length {T}")

    # ------------------------------------------------------------------ views
    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_turns(self) -> int:
        return sum(1 for s in self.spans if s.kind == "action")

    @property
    def last_action_index(self) -> int:
        idx = torch.nonzero(self.action_mask).flatten()
        return int(idx[-1]) if idx.numel() else -1

    @property
    def trainable(self) -> bool:
        return self.status != "failed"

    @property
    def episode(self) -> str:
        """The episode it belongs to: a harness episode's id, which its segments share
        (rollout/agent_endpoint/session.py), else the trajectory's own id (one episode, one trajectory)."""
        return str(self.info.get("episode", self.traj_id))

    @property
    def ends_episode(self) -> bool:
        """Whether it is its episode's last trajectory (``info["segment"]`` of ``info["segments"]``)."""
        n = self.info.get("segments")
        return n is None or int(self.info.get("segment", 0)) == int(n) - 1

    def min_version(self) -> int:
        v = self.versions[self.action_mask]
        return int(v.min()) if v.numel() else -1

    def max_version(self) -> int:
        v = self.versions[self.action_mask]
        return int(v.max()) if v.numel() else -1

    def turn_ids(self) -> torch.Tensor:
        """int64 [T]: index of the action turn for action tokens, -1 elsewhere (for step-level GAE)."""
        out = torch.full((self.length,), -1, dtype=torch.int64)
        turn = 0
        for s in self.spans:
            if s.kind == "action":
                out[s.start:s.end] = turn
                turn += 1
        return out

    # ------------------------------------------------------------------ metadata (JSON-safe)
    def meta(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "traj_id": self.traj_id,
            "prompt_id": self.prompt_id,
            "env": self.env,
            "reward": self.reward,
            "status": self.status,
            "bootstrap": self.bootstrap,
            "error": self.error,
            "spans": [[s.start, s.end, s.kind] for s in self.spans],
            "timings": self.timings,
            "info": self.info,
            "routes": self.routed_experts is not None,
        }


class TrajectoryBuilder:
    """Builds a trajectory by appending token ids, never by re-tokenizing text.

    Sampled ids go in exactly as sampled (stop/EOS included, with its log-prob); observation text is
    tokenized on its own by the caller (chat-template role markers included) and added as observation.
    """

    def __init__(self, prompt_id: str = "", env: str = "", traj_id: str | None = None):
        self.prompt_id, self.env = prompt_id, env
        self.traj_id = traj_id or uuid.uuid4().hex
        self.tokens: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.spans: list[Span] = []
        self.timings: dict[str, float] = {}
        self.info: dict[str, Any] = {}
        self.routes: list[torch.Tensor] | None = None  # per generate call, stitched (see add_routes)
        self._routes_len = 0
        self._t0 = time.time()

    def __len__(self) -> int:
        return len(self.tokens)

    def _append(self, ids: Sequence[int], kind: str, logprobs=None, versions=None) -> None:
        ids = [int(i) for i in ids]
        if not ids:
            return
        start = len(self.tokens)
        self.tokens += ids
        is_action = kind == "action"
        self.mask += [is_action] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if is_action else [0.0] * len(ids)
        self.versions += [int(v) for v in versions] if is_action else [-1] * len(ids)
        # Merge with the previous span of the same kind (e.g. two observation chunks in a row).
        if self.spans and self.spans[-1].kind == kind:
            self.spans[-1] = Span(self.spans[-1].start, start + len(ids), kind)
        else:
            self.spans.append(Span(start, start + len(ids), kind))

    def add_prompt(self, ids: Sequence[int]) -> None:
        self._append(ids, "prompt")

    def add_observation(self, ids: Sequence[int]) -> None:
        self._append(ids, "observation")

    def add_action(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int] | int) -> None:
        if isinstance(versions, int):
            versions = [versions] * len(ids)
        if not (len(ids) == len(logprobs) == len(versions)):
            raise TrajectoryError(
                f"trajectory {self.traj_id}: action has {len(ids)} ids, {len(logprobs)} logprobs, "
                f"{len(versions)} versions")
        self._append(ids, "action", logprobs, versions)

    @property
    def routes_covered(self) -> int:
        """Tokens whose routes are recorded: the next generate call asks for routes from here on."""
        return self._routes_len

    def add_routes(self, start: int, routes: torch.Tensor) -> None:
        """Routes [n, layers, topk] of tokens start..start+n-1, as one generate call returned them.

        Each call must continue exactly where the previous one ended (no gap, no token twice): an engine
        returns the routes of the prompt tokens from `start` (vLLM's routed_experts_prompt_start; the
        re-prefilled history before it was covered by earlier turns) and of every sampled token but
        its last.
        """
        routes = torch.as_tensor(routes)
        if routes.dim() != 3:
            raise TrajectoryError(f"trajectory {self.traj_id}: routes must be [n, layers, topk], "
                                  f"got {tuple(routes.shape)}")
        if start != self._routes_len:
            raise TrajectoryError(f"trajectory {self.traj_id}: routes start at token {start}, but tokens "
                                  f"0..{self._routes_len - 1} are covered: routes must tile the tokens")
        if self.routes is None:
            self.routes = []
        elif self.routes and routes.shape[1:] != self.routes[0].shape[1:]:
            raise TrajectoryError(f"trajectory {self.traj_id}: routes of shape {tuple(routes.shape)} after "
                                  f"{tuple(self.routes[0].shape)}: layers / topk changed between turns")
        self.routes.append(routes)
        self._routes_len += routes.shape[0]

    def finish(self, status: str, reward: float = 0.0, bootstrap: float | str | None = None,
               error: str | None = None, info: dict | None = None) -> Trajectory:
        self.timings.setdefault("rollout_s", time.time() - self._t0)
        if status == "truncated" and bootstrap is None:
            bootstrap = "critic"
        routes = None
        if self.routes and status != "failed":  # a failed episode is never trained on: no routes kept
            dtype = max((r.dtype for r in self.routes), key=_ROUTE_DTYPES.index)
            routes = torch.cat([r.to(dtype) for r in self.routes])
        return Trajectory(
            tokens=torch.tensor(self.tokens, dtype=torch.int64),
            action_mask=torch.tensor(self.mask, dtype=torch.bool),
            rollout_logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            versions=torch.tensor(self.versions, dtype=torch.int64),
            spans=list(self.spans), reward=reward, status=status, bootstrap=bootstrap,
            prompt_id=self.prompt_id, env=self.env, traj_id=self.traj_id, error=error,
            timings=dict(self.timings), info={**self.info, **(info or {})}, routed_experts=routes)


# ---------------------------------------------------------------------- collation


@dataclass
class TrajectoryBatch:
    """A padded batch, [B, T] per-token tensors, right padded. Training works on this.

    rewards holds each trajectory's reward on its last action token (0 elsewhere);
    bootstrap_state is, for truncated rows whose final value comes from the critic, the position t
    whose state value (the state ending with token t) bootstraps the row, and -1 elsewhere;
    bootstrap_values holds the given values (0 where the critic's is used).
    routes ([B, T, layers, topk], only when some trajectory carries routed_experts) holds expert id + 1,
    and 0 where the engine gave no route (a row without routes, the tokens after R, padding): zero
    padding then means "route freely" wherever the batch is padded or split.
    """

    tokens: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # bool [B, T] (real tokens)
    action_mask: torch.Tensor  # bool [B, T]
    rollout_logprobs: torch.Tensor  # float32 [B, T]
    versions: torch.Tensor  # int64 [B, T]
    rewards: torch.Tensor  # float32 [B, T]
    turn_ids: torch.Tensor  # int64 [B, T]
    lengths: torch.Tensor  # int64 [B]
    bootstrap_values: torch.Tensor  # float32 [B]
    bootstrap_state: torch.Tensor  # int64 [B], -1 where bootstrap_values is used
    traj_ids: list[str]
    prompt_ids: list[str]
    routes: torch.Tensor | None = None  # uint8/int16/int32 [B, T, layers, topk], expert id + 1 (0 = none)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def bootstrap_from_critic(self) -> torch.Tensor:
        """bool [B]: rows whose bootstrap is a critic value."""
        return self.bootstrap_state >= 0

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}


def collate_padded(trajs: Sequence[Trajectory], pad_id: int = 0, pad_to_multiple: int = 1) -> TrajectoryBatch:
    if not trajs:
        raise ValueError("collate_padded: no trajectories")
    failed = [t.traj_id for t in trajs if not t.trainable]
    if failed:
        raise ValueError(f"collate_padded: failed trajectories cannot be trained on: {failed}")
    B = len(trajs)
    T = max(t.length for t in trajs)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    tokens = torch.full((B, T), pad_id, dtype=torch.int64)
    attn = torch.zeros((B, T), dtype=torch.bool)
    amask = torch.zeros((B, T), dtype=torch.bool)
    lps = torch.zeros((B, T), dtype=torch.float32)
    vers = torch.full((B, T), -1, dtype=torch.int64)
    rew = torch.zeros((B, T), dtype=torch.float32)
    turns = torch.full((B, T), -1, dtype=torch.int64)
    boot = torch.zeros(B, dtype=torch.float32)
    boot_state = torch.full((B,), -1, dtype=torch.int64)
    for i, t in enumerate(trajs):
        n = t.length
        tokens[i, :n] = t.tokens
        attn[i, :n] = True
        amask[i, :n] = t.action_mask
        lps[i, :n] = t.rollout_logprobs
        vers[i, :n] = t.versions
        turns[i, :n] = t.turn_ids()
        rew[i, t.last_action_index] = t.reward
        if t.status == "truncated":
            if t.bootstrap == "critic":
                boot_state[i] = n - 1
            elif t.bootstrap == "critic_before_stop":
                boot_state[i] = n - 2
            else:
                boot[i] = float(t.bootstrap)
    return TrajectoryBatch(tokens, attn, amask, lps, vers, rew, turns,
                           torch.tensor([t.length for t in trajs], dtype=torch.int64), boot, boot_state,
                           [t.traj_id for t in trajs], [t.prompt_id for t in trajs], collate_routes(trajs, T))


def collate_routes(trajs: Sequence[Trajectory], width: int) -> torch.Tensor | None:
    """[B, width, layers, topk] expert id + 1 (0 = no route), or None when no trajectory has routes."""
    return stack_routes([t.routed_experts for t in trajs], width)


def stack_routes(rows: Sequence[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """The batch's ``routes`` field from per-row [R, layers, topk] expert ids (None: a row without
    routes): [B, width, layers, topk] expert id + 1 (0 = no route), or None when no row has routes."""
    routed = [r for r in rows if r is not None]
    if not routed:
        return None
    shapes = {tuple(r.shape[1:]) for r in routed}
    if len(shapes) != 1:
        raise ValueError(f"routes of one batch have different [layers, topk]: {sorted(shapes)}")
    (layers, topk), = shapes
    top = max(int(r.max()) if r.numel() else 0 for r in routed) + 1  # the largest value stored
    # The widest per-token field of a batch (Qwen3-30B-A3B: 48 layers x top-8), so the smallest dtype.
    dtype = torch.uint8 if top <= 255 else (torch.int16 if top <= torch.iinfo(torch.int16).max else torch.int32)
    out = torch.zeros((len(rows), width, layers, topk), dtype=dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, :r.shape[0]] = r.to(dtype) + 1
    return out


# ---------------------------------------------------------------------- on-disk format
# One safetensors file holds any number of trajectories: the per-token tensors concatenated, an
# offsets tensor, and the JSON metadata of each trajectory in the safetensors header. Lossless
# (float32 log-probs stay bit-exact), memory-mappable, and written atomically (temp file + rename).


def save_trajectories(path: str | os.PathLike, trajs: Sequence[Trajectory]) -> None:
    from safetensors.torch import save_file

    trajs = list(trajs)
    lengths = torch.tensor([t.length for t in trajs], dtype=torch.int64)
    offsets = torch.zeros(len(trajs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)

    def cat(name, dtype):
        return torch.cat([getattr(t, name) for t in trajs]).to(dtype) if trajs else torch.zeros(0, dtype=dtype)

    tensors = {
        "offsets": offsets,
        "tokens": cat("tokens", torch.int64),
        "action_mask": cat("action_mask", torch.uint8),
        "rollout_logprobs": cat("rollout_logprobs", torch.float32),
        "versions": cat("versions", torch.int64),
    }
    tensors.update(_route_tensors(trajs))
    metadata = {"format": "megatron_sao.trajectories", "format_version": str(FORMAT_VERSION),
                "meta": json.dumps([t.meta() for t in trajs])}
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _route_tensors(trajs: list[Trajectory]) -> dict[str, torch.Tensor]:
    """routed_experts of every trajectory concatenated ([sum R, layers, topk], the widest dtype among
    them) with route_offsets [n + 1]; a trajectory without routes has an empty range and meta routes=false."""
    routed = [t.routed_experts for t in trajs if t.routed_experts is not None]
    if not routed:
        return {}
    shapes = {tuple(r.shape[1:]) for r in routed}
    if len(shapes) != 1:
        raise ValueError(f"save_trajectories: trajectories route with different [layers, topk]: {sorted(shapes)}")
    dtype = max((r.dtype for r in routed), key=_ROUTE_DTYPES.index)
    lengths = torch.tensor([0 if t.routed_experts is None else t.routed_experts.shape[0] for t in trajs])
    offsets = torch.zeros(len(trajs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return {"route_offsets": offsets, "routed_experts": torch.cat([r.to(dtype) for r in routed]).contiguous()}


class TrajectoryFileError(UserError, ValueError):
    """A trajectory file that cannot be used; the message names the file and what is wrong."""


_FILE_TENSORS = {"offsets": torch.int64, "tokens": torch.int64, "action_mask": torch.uint8,
                 "rollout_logprobs": torch.float32, "versions": torch.int64}


def load_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    """Read a trajectory file, checking its structure before building anything: tensors present with
    their dtypes, one offset per trajectory + 1, offsets rising from 0 to exactly the token count,
    per-token tensors of one length, then every trajectory's own invariants."""
    from megatron_sao.files.safetensors_check import SafetensorsFileError, open_safetensors

    path = os.fspath(path)

    def bad(msg: str) -> TrajectoryFileError:
        return TrajectoryFileError(f"{path}: {msg}")

    try:
        f = open_safetensors(path)
    except SafetensorsFileError as e:
        raise TrajectoryFileError(str(e)) from None
    with f:
        metadata = f.metadata() or {}
        if metadata.get("format") != "megatron_sao.trajectories":
            raise bad(f"not a megatron_sao trajectory file (format={metadata.get('format')!r})")
        try:
            version = int(metadata.get("format_version", -1))
        except ValueError:
            raise bad(f"format_version {metadata.get('format_version')!r} is not an integer") from None
        if version > FORMAT_VERSION:
            raise bad(f"format version {version} is newer than this code ({FORMAT_VERSION})")
        missing = sorted(set(_FILE_TENSORS) - set(f.keys()))
        if missing:
            raise bad(f"missing tensor(s) {missing}")
        t = {k: f.get_tensor(k) for k in _FILE_TENSORS}
        has_routes = [k for k in ("route_offsets", "routed_experts") if k in f.keys()]
        if len(has_routes) == 1:
            raise bad(f"has {has_routes[0]!r} without its pair (route_offsets and routed_experts go together)")
        routes = (f.get_tensor("route_offsets"), f.get_tensor("routed_experts")) if has_routes else None
    for k, dtype in _FILE_TENSORS.items():
        if t[k].dtype != dtype or t[k].dim() != 1:
            raise bad(f"tensor {k!r} is {t[k].dtype} with shape {tuple(t[k].shape)}, expected 1-D {dtype}")
    try:
        metas = json.loads(metadata["meta"])
    except (KeyError, ValueError) as e:
        raise bad(f"the 'meta' header entry is missing or not JSON ({e})") from None
    if not isinstance(metas, list):
        raise bad("the 'meta' header entry is not a list")
    n_tok = t["tokens"].numel()
    for k in ("action_mask", "rollout_logprobs", "versions"):
        if t[k].numel() != n_tok:
            raise bad(f"length mismatch: {k} has {t[k].numel()} entries, tokens has {n_tok}")
    offsets = t["offsets"].tolist()
    if len(offsets) != len(metas) + 1:
        raise bad(f"{len(offsets)} offsets for {len(metas)} trajectories (expected {len(metas) + 1})")
    if offsets[0] != 0 or offsets[-1] != n_tok:
        raise bad(f"offsets run from {offsets[0]} to {offsets[-1]}, expected 0 to the token count {n_tok}")
    for i in range(len(metas)):
        if offsets[i + 1] <= offsets[i]:
            raise bad(f"offsets of trajectory {i} are [{offsets[i]}, {offsets[i + 1]}): empty or decreasing")
    route_of = _file_routes(routes, metas, bad)
    out = []
    for i, m in enumerate(metas):
        a, b = offsets[i], offsets[i + 1]
        try:
            out.append(Trajectory(
                tokens=t["tokens"][a:b], action_mask=t["action_mask"][a:b].bool(),
                rollout_logprobs=t["rollout_logprobs"][a:b], versions=t["versions"][a:b],
                spans=[Span(s, e, k) for s, e, k in m["spans"]], reward=m["reward"], status=m["status"],
                bootstrap=m["bootstrap"], prompt_id=m["prompt_id"], env=m["env"], traj_id=m["traj_id"],
                error=m["error"], timings=m["timings"], info=m["info"], routed_experts=route_of(i)))
        except TrajectoryError as e:
            raise bad(f"trajectory {i}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"trajectory {i}: malformed metadata ({type(e).__name__}: {e})") from None
    return out


def _file_routes(routes, metas: list, bad):
    """Check a file's route tensors against its trajectories; returns i -> routed_experts or None."""
    flags = [bool(m.get("routes", False)) if isinstance(m, dict) else False for m in metas]
    if routes is None:
        if any(flags):
            raise bad(f"{sum(flags)} trajectory(ies) have routes=true but the file has no routed_experts")
        return lambda i: None
    offsets, data = routes
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or len(offsets) != len(metas) + 1:
        raise bad(f"route_offsets is {offsets.dtype} {tuple(offsets.shape)}, expected 1-D int64 of "
                  f"{len(metas) + 1} entries")
    if data.dtype not in _ROUTE_DTYPES or data.dim() != 3:
        raise bad(f"routed_experts is {data.dtype} {tuple(data.shape)}, expected [N, layers, topk] of "
                  f"{[str(d) for d in _ROUTE_DTYPES]}")
    o = offsets.tolist()
    if o[0] != 0 or o[-1] != data.shape[0] or any(o[i + 1] < o[i] for i in range(len(metas))):
        raise bad(f"route_offsets run {o[0]}..{o[-1]} (or decrease), expected 0..{data.shape[0]} rising")
    for i, flag in enumerate(flags):
        if not flag and o[i + 1] != o[i]:
            raise bad(f"trajectory {i} has routes=false but {o[i + 1] - o[i]} route rows")
    return lambda i: data[o[i]:o[i + 1]].clone() if flags[i] else None


def trajectories_equal(a: Trajectory, b: Trajectory) -> bool:
    """Exact equality of every field (bit-exact tensors), for tests and resume checks."""
    routes_equal = (a.routed_experts is None and b.routed_experts is None) or (
        a.routed_experts is not None and b.routed_experts is not None
        and a.routed_experts.dtype == b.routed_experts.dtype and torch.equal(a.routed_experts, b.routed_experts))
    return (torch.equal(a.tokens, b.tokens) and torch.equal(a.action_mask, b.action_mask)
            and torch.equal(a.rollout_logprobs.view(torch.int32), b.rollout_logprobs.view(torch.int32))
            and torch.equal(a.versions, b.versions) and a.meta() == b.meta() and routes_equal)
