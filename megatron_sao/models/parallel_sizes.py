"""Model-parallel sizes of one Megatron world (what `initialize_model_parallel` is called with)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.models.hf_config import ModelSpec


@dataclass(frozen=True)
class ParallelSizes:
    """Tensor / pipeline / expert parallel sizes.

    `etp` is Megatron's expert_tensor_parallel_size. None means "Megatron's default", which is
    `tp` (experts are tensor-sharded like dense layers). Training an MoE model with tp > 1 also
    needs sequence_parallel=True (Megatron raises otherwise in training mode). With EP it is common to set etp=1 so that
    each expert lives whole on one rank; TP=2 + EP=2 on two ranks *requires* etp=1, because the
    expert grid etp*ep must fit into the tp*dp ranks of one pipeline stage.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelSizes.{name} must be a positive int, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"ParallelSizes.etp must be a positive int or None, got {self.etp!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelSizes.sequence_parallel=True needs tp > 1")

    @property
    def expert_tp(self) -> int:
        """Effective expert tensor-parallel size."""
        return self.tp if self.etp is None else self.etp

    def validate_for(self, spec: ModelSpec, world_size: int | None = None) -> None:
        """Raise ValueError if these sizes cannot shard `spec` (or do not fit `world_size`)."""
        if spec.num_kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide num_kv_heads={spec.num_kv_heads} (qkv is split by query group)")
        if spec.vocab_size % self.tp:
            raise ValueError(f"tp={self.tp} must divide vocab_size={spec.vocab_size} (vocab padding is not supported)")
        if spec.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} must divide num_layers={spec.num_layers}")
        if not spec.is_moe:
            if self.ep != 1:
                raise ValueError(f"ep={self.ep} needs an MoE model; {spec.arch} is dense")
            if spec.ffn_hidden_size % self.tp:
                raise ValueError(f"tp={self.tp} must divide ffn_hidden_size={spec.ffn_hidden_size}")
        else:
            if spec.num_experts % self.ep:
                raise ValueError(f"ep={self.ep} must divide num_experts={spec.num_experts}")
            if spec.moe_ffn_hidden_size % self.expert_tp:
                raise ValueError(f"expert tp={self.expert_tp} must divide moe_ffn_hidden_size={spec.moe_ffn_hidden_size}")
        if world_size is not None:
            stage = world_size // self.pp
            if world_size % (self.tp * self.pp):
                raise ValueError(f"world size {world_size} is not a multiple of tp*pp={self.tp * self.pp}")
            if spec.is_moe and stage % (self.expert_tp * self.ep):
                raise ValueError(f"expert grid etp*ep={self.expert_tp * self.ep} does not divide the "
                                 f"{stage} ranks of a pipeline stage")
