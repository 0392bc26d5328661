"""The explained-variance ceiling of a task: how much of the return an oracle value explains.

The oracle's value of a state is the policy's success rate given what the visible prefix says about
the episode so far, estimated from rollouts. What it reads: the task's reference solution (the
environment's `reference_actions`: the actions of a correct episode) and the actions taken so far,
compared on their significant characters (digits and `+-*/=`, so wording and formatting do not
count): whether every earlier action matched its reference, whether the current action still
matches so far, and how far into it the policy is. A mistake therefore shows in the state from the
token that makes it on, which is the most any value function of the prefix can know about it; on
the chain tasks the environment also says so in the next tool result, where a critic can read it.

Key of the state before an action token, coarse to fine: (on track, reference actions, turn,
significant characters typed in this action while on track, else -1). On track comes first: it is
what a mistake changes, so a rare off-track state falls back to other off-track states, never to a
mix of both. The oracle's value of a key
is the token-mean return of the training rollouts' tokens with that key (the MSE-optimal constant
for the same token-mean loss the critic fits); a key with fewer than `min_support` training
trajectories falls back to its longest prefix that has them. The ceiling is the explained variance
of these values on held-out rollouts, the same tokens and formula as the critic's held-out EV, so
the two stand side by side. It is an estimate: a finer key or more rollouts could explain more, and
a critic that also reads the prompt's difficulty (the numbers) could exceed it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from megatron_sao.algorithms import critic_fit
from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.targets import critic_targets
from megatron_sao.trajectory import Trajectory, collate_padded

_SIGNIFICANT = re.compile(r"[0-9+\-*/=]")


def significant(text: str) -> str:
    """The characters of `text` that change an arithmetic action's meaning: digits and + - * / =."""
    return "".join(_SIGNIFICANT.findall(text))


def progress_keys(action_pieces: Sequence[Sequence[str]], references: Sequence[str]) -> list[tuple]:
    """Per action token (all turns, in order), the oracle's key of the state before it.

    `action_pieces[k]` are the decoded texts of turn k's action tokens; `references` the actions of a
    correct episode. A turn past the references is off track (a correct episode has ended)."""
    refs = [significant(r) for r in references]
    keys: list[tuple] = []
    on = True
    for turn, pieces in enumerate(action_pieces):
        ref = refs[turn] if turn < len(refs) else None
        typed = ""
        for piece in pieces:
            now = on and ref is not None and ref.startswith(typed)
            keys.append((now, len(refs), turn, len(typed) if now else -1))
            typed += significant(piece)
        on = on and ref is not None and typed == ref
    return keys


class OracleTable:
    """Token-mean returns per key and per key prefix (`progress_keys`), with a support threshold."""

    def __init__(self, min_support: int = 5) -> None:
        self.min_support = min_support
        self.sums: dict[tuple, float] = defaultdict(float)
        self.counts: dict[tuple, int] = defaultdict(int)
        self.trajs: dict[tuple, set[int]] = defaultdict(set)
        self.total = self.n = 0.0

    def add(self, traj_index: int, keys: Sequence[Hashable], returns: Sequence[float]) -> None:
        for key, r in zip(keys, returns, strict=True):
            for depth in range(1, len(key) + 1):
                k = key[:depth]
                self.sums[k] += r
                self.counts[k] += 1
                self.trajs[k].add(traj_index)
            self.total += r
            self.n += 1

    def value(self, key: tuple) -> float:
        for depth in range(len(key), 0, -1):
            k = key[:depth]
            if len(self.trajs.get(k, ())) >= self.min_support:
                return self.sums[k] / self.counts[k]
        return self.total / max(self.n, 1)


@dataclass
class OracleCeiling:
    explained_variance: float  # of the oracle's values on the held-out rollouts
    fit: dict[str, float]  # critic_fit of the oracle on the held-out rollouts (EV by turn, means)
    train_trajectories: int
    heldout_trajectories: int
    keys: int  # distinct full keys seen in training


def action_pieces(traj: Trajectory, decode: Callable[[list[int]], str]) -> list[list[str]]:
    """The decoded text of every action token, grouped by action turn (the trajectory's action spans)."""
    ids = traj.tokens.tolist()
    return [[decode([ids[i]]) for i in range(s.start, s.end)] for s in traj.spans if s.kind == "action"]


def action_returns(traj: Trajectory, algo: AlgorithmConfig) -> torch.Tensor:
    """[number of action tokens]: the critic's return targets with every value 0 (for a terminated
    trajectory with gamma 1 and critic lambda 1, its reward at every token)."""
    batch = collate_padded([traj])
    _, _, returns = critic_targets(batch, torch.zeros(batch.tokens.shape, dtype=torch.float32), algo)
    return returns[0][batch.action_mask[0]]


def oracle_ceiling(train: Sequence[Trajectory], heldout: Sequence[Trajectory],
                   references: Callable[[Trajectory], Sequence[str]], decode: Callable[[list[int]], str],
                   algo: AlgorithmConfig, min_support: int = 5) -> OracleCeiling:
    """The oracle fitted on `train`, scored on `heldout` (module docstring); `references(traj)` gives
    the reference actions of the trajectory's task."""
    table = OracleTable(min_support)
    for i, t in enumerate(train):
        table.add(i, progress_keys(action_pieces(t, decode), references(t)), action_returns(t, algo).tolist())
    values, returns, turns = [], [], []
    for t in heldout:
        keys = progress_keys(action_pieces(t, decode), references(t))
        values += [table.value(k) for k in keys]
        returns += action_returns(t, algo).tolist()
        turns += [k[2] for k in keys]
    v, r = torch.tensor([values], dtype=torch.float32), torch.tensor([returns], dtype=torch.float32)
    fit = critic_fit(v, r, torch.ones_like(v, dtype=torch.bool), torch.tensor([turns]))
    return OracleCeiling(fit["explained_variance"], fit, len(train), len(heldout),
                         sum(1 for k in table.counts if len(k) == 4))
