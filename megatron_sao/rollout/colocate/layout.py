"""Which trainer ranks form which colocated vLLM engine (pure arithmetic, no process groups).

vLLM's external-launcher executor lays its groups out over the torch.distributed world as
``ExternalDP x DP x PP x PCP x TP`` (``vllm/distributed/parallel_state.py``): with PP = DP = 1 the
tensor-parallel groups are consecutive blocks of ``rollout_tp`` ranks. So engine ``e`` is ranks
``e*rollout_tp .. (e+1)*rollout_tp - 1``, there are ``world / rollout_tp`` data-parallel engines,
and a rank's place in its engine is ``rank % rollout_tp``. The colocated test launches check this
against the groups the real vLLM builds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLayout:
    world: int  # trainer ranks = GPUs
    rollout_tp: int  # tensor-parallel size of one engine (cluster.rollout_tp)
    rank: int  # this rank

    def __post_init__(self) -> None:
        problems = layout_problems(self.world, self.rollout_tp)
        if problems:
            raise ValueError("; ".join(problems))
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    @property
    def engines(self) -> int:
        return self.world // self.rollout_tp

    @property
    def engine(self) -> int:
        """Index of the engine this rank holds a shard of."""
        return self.rank // self.rollout_tp

    @property
    def engine_rank(self) -> int:
        """This rank's tensor-parallel rank inside its engine."""
        return self.rank % self.rollout_tp

    def ranks_of(self, engine: int) -> list[int]:
        if not 0 <= engine < self.engines:
            raise ValueError(f"engine {engine} does not exist ({self.engines} engines)")
        return list(range(engine * self.rollout_tp, (engine + 1) * self.rollout_tp))

    def leaders(self) -> list[int]:
        """The global rank of every engine's tensor-parallel rank 0, by engine index."""
        return [e * self.rollout_tp for e in range(self.engines)]


def layout_problems(world: int, rollout_tp: int, gpus_per_node: int | None = None) -> list[str]:
    """Why `rollout_tp` engines cannot tile `world` ranks (empty when they can), naming the key."""
    out = []
    if rollout_tp < 1:
        out.append(f"cluster.rollout_tp must be >= 1, got {rollout_tp}")
    elif world % rollout_tp:
        out.append(f"cluster.rollout_tp={rollout_tp} must divide the trainer world ({world} ranks): every rank "
                   "hosts one shard of one colocated engine")
    elif gpus_per_node is not None and gpus_per_node % rollout_tp:
        out.append(f"cluster.rollout_tp={rollout_tp} must divide cluster.gpus_per_node={gpus_per_node}: an engine's "
                   "tensor-parallel all-reduces stay inside a node")
    return out
