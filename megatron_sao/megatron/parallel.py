"""torch.distributed + Megatron-Core parallel state, behind one small `ParallelContext`.

`init_parallel(sizes)` is the only place that creates process groups. It reads the launcher's
environment (torchrun: RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; srun: SLURM_PROCID/SLURM_NTASKS/
SLURM_LOCALID), falls back to a single local process, picks nccl with CUDA and gloo without, and
then builds Megatron's TP/PP/EP/DP groups. The expert-tensor-parallel size comes from
`ParallelSizes.expert_tp` (`parallel.etp`, or the one default rule in models/parallel_sizes.py), so
the sharding code, the planner and the process groups read the same number.

Every collective made through these groups inherits the process-group timeout, so a rank that dies
or hangs turns into an error on the others instead of a silent hang (weight sync relies on that).
Timeout rule: no rank waits for a rank-0-only phase (batch wait, eval, rollout start, weight push)
inside a collective. The collective after such a phase is preceded by `rank0_gate.shared().arrive()`
(a store poll, no NCCL work pending), so the process-group timeout only has to cover what happens
*between* the collectives of one sequence: `process_group_timeout_s` derives it from the config.

Collective-device rule: every tensor handed to a collective lives on `ctx.device` (the GPU under
NCCL), or on the host only for a group created with backend="gloo". `distributed.devices.collective_device(group)`
answers for code that has no `ParallelContext`. Under `SAO_COLLECTIVE_GUARD=1` on a CPU build
(the test suite), `init_parallel` installs `collective_guard`, which makes `ctx.device` a pretend
accelerator and fails any collective that breaks the rule.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sao.distributed import collective_guard, rank0_gate
from megatron_sao.distributed.ports import free_port
from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
PG_TIMEOUT_ENV = "SAO_PG_TIMEOUT_S"
PG_TIMEOUT_MARGIN_S = 120.0


def _launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun or srun; (0, 1, 0) for a plain `python`."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        if world > 1 and "MASTER_ADDR" not in os.environ:
            raise RuntimeError(
                "srun launch without MASTER_ADDR/MASTER_PORT: export them in the sbatch script "
                "(e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))"
            )
        return rank, world, int(os.environ.get("SLURM_LOCALID", 0))
    return 0, 1, 0


@dataclass(frozen=True)
class ParallelContext:
    """Ranks and sizes of this process in the Megatron world (groups are fetched on demand).

    Megatron's parallel_state is process-global, so the groups themselves are properties that read
    it rather than copies that could go stale after `destroy_parallel()`.
    """

    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    sequence_parallel: bool
    backend: str
    device: torch.device
    timeout_s: float

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def tp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline (same TP/DP coordinates)."""
        return dist.get_global_rank(self.pp_group, self.pp - 1)

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/{self.pp} "
            f"ep {self.ep_rank}/{self.ep} dp {self.dp_rank}/{self.dp} sp={self.sequence_parallel} "
            f"backend={self.backend}"
        )


def init_parallel(sizes, *, seed: int = 1234, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Initialise torch.distributed (if needed) and Megatron parallel state for `sizes`.

    Args:
        sizes: a `ParallelSizes` (tp, pp, ep, sequence_parallel, expert_tp); its world-size rules
            are checked before any process group is created.
        seed: base seed for Megatron's model-parallel RNG tracker and torch's default generator.
        timeout_s: process-group timeout applied to every collective.
    """
    ensure_cpu_compat()
    guarded = collective_guard.enabled() and collective_guard.install()  # before any group exists
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    tp, pp, ep, sp = int(sizes.tp), int(sizes.pp), int(sizes.ep), bool(sizes.sequence_parallel)
    etp = int(sizes.expert_tp)
    rank, world, local_rank = _launcher_env()
    sizes.validate_for(world_size=world)  # the same rules `sao plan` applies (models/parallel_sizes.py)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world > 1:
                raise RuntimeError("MASTER_PORT is not set for a multi-process launch")
            os.environ["MASTER_PORT"] = str(free_port())
        if use_cuda:
            torch.cuda.set_device(local_rank)
        if world > 1:
            _choose_gloo_interface()
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    elif dist.get_world_size() != world:
        raise RuntimeError(f"torch.distributed already initialised with world size {dist.get_world_size()}, "
                           f"env says {world}")
    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised: call destroy_parallel() first")
    rank0_gate.start(dist.get_rank(), world)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, int(round(timeout_s / 60.0))),
    )
    # The inference tracker avoids torch.cuda RNG state calls (absent on CPU); dropout is 0 in
    # every config this project builds, so no TP-region randomness is lost.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not use_cuda)
    torch.manual_seed(seed)
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        sequence_parallel=sp,
        backend=backend,
        device=_training_device(use_cuda, guarded),
        timeout_s=timeout_s,
    )


def _choose_gloo_interface() -> None:
    """Set GLOO_SOCKET_IFNAME before any group exists (megatron-core creates gloo groups; see
    distributed/socket_ifname.py): as given, else NCCL_SOCKET_IFNAME's names, else the route to MASTER_ADDR."""
    from megatron_sao.distributed.socket_ifname import GLOO, gloo_ifname_from_env, interface_for

    name = gloo_ifname_from_env(os.environ) or interface_for(os.environ["MASTER_ADDR"])
    if name and not os.environ.get(GLOO):
        os.environ[GLOO] = name
        logger.info("%s=%s (route to MASTER_ADDR=%s)", GLOO, name, os.environ["MASTER_ADDR"])


def process_group_timeout_s(longest_rank0_call_s: float, environ=None) -> float:
    """The collective timeout of a training job.

    Rank-0-only phases between collective sequences do not count (the others wait at a Rank0Gate).
    What does count is one call rank 0 makes *between* two collectives of one sequence while the
    other ranks already wait in the next: pushing one streamed weight bucket to the rollout engines
    (bounded by `rollout.timeout_s`, the caller's `longest_rank0_call_s`). Default:
    max(DEFAULT_TIMEOUT_S, that + PG_TIMEOUT_MARGIN_S). `SAO_PG_TIMEOUT_S` overrides it; an override
    that cannot hold that call is refused rather than left to kill the job mid-sync.
    """
    environ = os.environ if environ is None else environ
    derived = max(DEFAULT_TIMEOUT_S, float(longest_rank0_call_s) + PG_TIMEOUT_MARGIN_S)
    raw = environ.get(PG_TIMEOUT_ENV)
    if raw in (None, ""):
        return derived
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{PG_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > longest_rank0_call_s:
        raise ValueError(f"{PG_TIMEOUT_ENV}={raw} must exceed rollout.timeout_s={longest_rank0_call_s:g}: rank 0 may "
                         "spend that long pushing one weight bucket while the other ranks wait in the weight "
                         f"export's next collective (unset it to get {derived:g}s)")
    return value


def _training_device(use_cuda: bool, guarded: bool) -> torch.device:
    if use_cuda:
        return torch.device("cuda", torch.cuda.current_device())
    return collective_guard.PRETEND_DEVICE if guarded else torch.device("cpu")


def destroy_parallel(*, destroy_process_group: bool = True) -> None:
    """Tear down Megatron parallel state (and the default process group unless told not to)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        rank0_gate.stop()
        dist.destroy_process_group()
