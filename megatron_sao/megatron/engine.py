"""`MegatronEngine`: one Megatron-Core model (actor or critic) with its own optimizer and schedule.

The actor and the critic are two engines in the same Megatron world (same parallel state, two
models, two optimizers, two LRs). Every public call is collective: every rank calls it with the
same full batch (see `batching`), and every rank gets the same result back.

Threading: on CPU the cuda->cpu TorchFunctionMode from `cpu_compat` is thread-local, so create and
call an engine on the thread that called `ensure_cpu_compat()` / `init_parallel()`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_sao.megatron import batching
from megatron_sao.megatron import forward as fwd
from megatron_sao.megatron.batching import Batch
from megatron_sao.megatron.compute_cost import CostModel
from megatron_sao.megatron.optimizer import OptimConfig, build_optimizer, effective_for, safe_optimizer_step
from megatron_sao.megatron.parallel import ParallelContext, init_parallel
from megatron_sao.megatron.wgrad_accumulation import enable_cpu_wgrad_accumulation
from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.parallel_sizes import ParallelSizes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitSource:
    """Where the weights come from: exactly one of an HF directory, a converted Megatron
    checkpoint directory (megatron_sao.checkpoint format), or a random-init seed."""

    hf_dir: str | None = None
    megatron_dir: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("hf_dir", "megatron_dir", "seed") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"InitSource needs exactly one of hf_dir / megatron_dir / seed, got {given or 'none'}")
        for n in ("hf_dir", "megatron_dir"):
            path = getattr(self, n)
            if path is not None and not os.path.isdir(path):
                raise FileNotFoundError(f"InitSource.{n}: no directory at {path}")

    @classmethod
    def from_hf(cls, path: str) -> "InitSource":
        return cls(hf_dir=os.fspath(path))

    @classmethod
    def from_megatron(cls, path: str) -> "InitSource":
        return cls(megatron_dir=os.fspath(path))

    @classmethod
    def random(cls, seed: int) -> "InitSource":
        return cls(seed=int(seed))


@dataclass
class StepResult:
    """Outcome of one `train_step` (identical on every rank)."""

    loss: float
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: bool = False


def _hf_has_value_head(hf_dir: str) -> bool:
    from megatron_sao.checkpoint.hf_io import HFCheckpointReader

    return "score.weight" in HFCheckpointReader(hf_dir)


def _finalize_grads_sum(model_chunks, num_tokens=None, **kwargs):
    """Megatron's finalize_model_grads without the 1/num_tokens rescale (see forward.py docstring)."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model_chunks, num_tokens=None, **kwargs)


class MegatronEngine:
    """Megatron-Core model + DDP + (distributed) optimizer for one role ("actor" or "critic").

    Args:
        spec: architecture (from `model_spec_from_hf`).
        sizes: TP/PP/EP sizes; must match the live parallel state if one exists.
        optim: optimizer settings of this engine.
        role: "actor" (outputs per-token log-probs) or "critic" (per-token values).
        init: weight source (HF dir, Megatron checkpoint dir, or random seed).
        micro_batch_size: the most rows of one micro-batch.
        max_tokens_per_micro_batch: the most padded tokens (rows x width) of one micro-batch; None =
            micro-batches of exactly micro_batch_size rows (see megatron/batching.py for the plan).
        assignment: "balanced" (rows over DP ranks by compute cost, per-rank micro-batches) or
            "contiguous" (the rule it replaced; the baseline of tests and benchmarks).
        freeze_patterns: names (fnmatch globs or "re:" regexes on canonical names) to freeze,
            e.g. models.freeze.CRITIC_FROZEN_ATTENTION for SAO's critic.
        grad_norm_groups: {group: patterns}; their grad norms land in StepResult.metrics as
            "grad_norm/<group>" (computed from the reduced, unclipped gradients).
        params_dtype: float32 or bfloat16 (bf16 keeps fp32 main params in the optimizer).
        ctx: an existing ParallelContext; created with `init_parallel(sizes)` when None.
        config_overrides: extra TransformerConfig fields (e.g. MoE aux-loss settings).
        value_head_init: the critic's head where the init source has none ("zero" or "normal";
            models/value_head.py); `fresh_value_head` then says so.
    """

    def __init__(
        self,
        spec: ModelSpec,
        sizes: ParallelSizes,
        optim: OptimConfig,
        *,
        role: str,
        init: InitSource,
        micro_batch_size: int = 1,
        max_tokens_per_micro_batch: int | None = None,
        assignment: str = "balanced",
        freeze_patterns: Sequence[str] = (),
        grad_norm_groups: Mapping[str, Sequence[str]] | None = None,
        params_dtype: torch.dtype = torch.float32,
        ctx: ParallelContext | None = None,
        config_overrides: Mapping | None = None,
        value_head_init: str = "zero",
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_sao.models.freeze import apply_freeze, check_patterns_matched_globally
        from megatron_sao.models.gpt import build_gpt_model, transformer_config_from_spec

        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        if max_tokens_per_micro_batch is not None and (not isinstance(max_tokens_per_micro_batch, int)
                                                       or max_tokens_per_micro_batch < 2):
            raise ValueError(f"max_tokens_per_micro_batch must be an int >= 2 or None, got "
                             f"{max_tokens_per_micro_batch!r}")
        if assignment not in ("balanced", "contiguous"):
            raise ValueError(f"assignment must be 'balanced' or 'contiguous', got {assignment!r}")
        if not isinstance(optim, OptimConfig):
            raise TypeError(f"optim must be an OptimConfig, got {type(optim).__name__}")
        self.ctx = ctx if ctx is not None else init_parallel(sizes)
        c = self.ctx
        if (c.tp, c.pp, c.ep, c.sequence_parallel) != (sizes.tp, sizes.pp, sizes.ep, sizes.sequence_parallel):
            raise ValueError(f"ParallelSizes {sizes} do not match the live parallel state ({c.describe()})")
        if c.etp != sizes.expert_tp:
            raise ValueError(f"ParallelSizes {sizes} (expert tp {sizes.expert_tp}) do not match the live parallel "
                             f"state (etp={c.etp})")
        # Every layout rule (incl. the refusal of MoE with etp*ep < tp, which trains with wrong
        # gradients on megatron-core 0.16.1) lives in ParallelSizes.problems, shared with `sao plan`.
        sizes.validate_for(spec, c.world_size)
        optim = effective_for(optim, c.dp)  # the distributed optimizer only where DP has several ranks
        self.spec, self.sizes, self.optim_config, self.role = spec, sizes, optim, role
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.assignment = assignment
        self.cost = CostModel.for_model(spec)
        self.state_version = 0
        self.grad_norm_groups = {k: list(v) for k, v in (grad_norm_groups or {}).items()}

        overrides = dict(config_overrides or {})
        overrides["calculate_per_token_loss"] = True  # see forward.py: exact global token-mean
        if enable_cpu_wgrad_accumulation():  # weight gradients GEMM'd into the DDP buffer (wgrad_accumulation.py)
            overrides.setdefault("gradient_accumulation_fusion", True)
        if role == "actor" and spec.is_moe:  # rollout routing replay (megatron/routing_replay.py)
            overrides["moe_enable_routing_replay"] = True
        self.config = transformer_config_from_spec(spec, sizes, params_dtype=params_dtype, **overrides)
        if init.seed is not None:
            # Same seed on every rank: with use_cpu_initialization Megatron builds each full
            # weight from the default generator and slices it, so layouts start identical.
            model_parallel_cuda_manual_seed(init.seed, inference_rng_tracker=not torch.cuda.is_available(),
                                            force_reset_rng=True)
            torch.manual_seed(init.seed)
        model = build_gpt_model(spec, self.config, role=role, pre_process=c.is_first_stage,
                                post_process=c.is_last_stage, value_head_init=value_head_init)
        model.to(c.device)
        # The MoE actor's routers replay (or, with replay_routes False, are only compared with) the
        # batch's `routes`; the critic routes by itself and never sees them.
        from megatron_sao.megatron.routing_replay import RouteSlice, RoutingReplay, install_router_replay

        moe_actor = role == "actor" and spec.is_moe  # the same on every rank, routers on this stage or not
        self.routing = RoutingReplay(install_router_replay(model) if moe_actor else [],
                                     RouteSlice(c.tp, c.tp_rank, c.sequence_parallel),
                                     recompute=self.config.recompute_granularity is not None, device=c.device,
                                     moe=moe_actor)
        self.replay_routes = False  # rollout.routing_replay: replay the engine's routes, not only measure
        self.last_routing_agreement: dict[str, float] | None = None  # of the latest logprobs() call with routes
        self.layout = self._rank_layout()
        self.shape_rule = self._shape_rule()
        # A critic whose head was just drawn (value_head_init), not loaded: its bias may then be set
        # from the first data it sees (set_value_head_bias).
        self.fresh_value_head = role == "critic" and init.megatron_dir is None and (
            init.seed is not None or not _hf_has_value_head(init.hf_dir))
        if init.hf_dir is not None:
            from megatron_sao.checkpoint.load import load_hf_into_model

            load_hf_into_model([model], init.hf_dir, spec, self.layout, role=role)
        elif init.megatron_dir is not None:
            from megatron_sao.checkpoint.load import load_megatron_checkpoint_into_model

            load_megatron_checkpoint_into_model([model], init.megatron_dir, self.layout)
        if freeze_patterns:
            report = apply_freeze([model], list(freeze_patterns), allow_empty_on_this_rank=True)
            check_patterns_matched_globally(report)
            self.freeze_report = report
        if not any(p.requires_grad for p in model.parameters()):
            # DDP/optimizer construction needs at least one trainable tensor per rank.
            raise ValueError(f"{role}: every parameter on rank {c.rank} is frozen; nothing to train")

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=optim.use_distributed_optimizer,
            average_in_collective=False,  # required by calculate_per_token_loss
            bucket_size=None,
        )
        self.module = model
        self.ddp = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=model)
        self.chunks = [self.ddp]
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = _finalize_grads_sum
        try:
            self.optimizer, self.scheduler = build_optimizer(optim, self.chunks, params_dtype)
        except Exception as exc:  # say which switch to flip instead of a deep Megatron traceback
            raise RuntimeError(
                f"building the Megatron optimizer failed ({exc!r}); with "
                f"use_distributed_optimizer={optim.use_distributed_optimizer} - try the other setting"
            ) from exc
        from megatron_sao.models.names import canonical_name

        self._param_names = {id(p): canonical_name(n) for n, p in self.module.named_parameters()}
        from megatron_sao.megatron.offload import TrainerOffload

        self._offload = TrainerOffload(self.ddp, self.optimizer, c.device)
        logger.info("%s engine ready: %s", role, c.describe())

    # ------------------------------------------------------------------ helpers
    def _rank_layout(self):
        from megatron_sao.checkpoint.sharding import RankLayout

        return RankLayout.from_parallel_state()

    def _require(self, *parts: str) -> None:
        """Refuse a call that would read offloaded state (a released storage segfaults on CPU)."""
        if not self._offload.resident(*parts):
            raise RuntimeError(f"{self.role}: {'/'.join(self._offload.offloaded())} offloaded to host "
                               f"(colocated placement); onload({list(parts)}) before this call")

    def _shape_rule(self) -> batching.ShapeRule:
        """What this layout's collectives need of micro-batch shapes (megatron/batching.py). An MoE
        layer's expert-parallel group spans DP ranks when ep > 1: every forward runs its dispatcher's
        collectives there, so every DP rank runs as many; the allgather dispatcher (the CPU build's)
        also gathers equal token counts, the alltoall one (GPU) exchanges counts first and does not.
        The pipeline's p2p buffers have one shape unless Megatron communicates shapes."""
        c, cfg = self.ctx, self.config
        moe_ep = self.spec.is_moe and c.ep > 1
        return batching.ShapeRule(equal_count=moe_ep,
                                  equal_shapes=moe_ep and cfg.moe_token_dispatcher_type == "allgather",
                                  fixed_shape=c.pp > 1 and not cfg.variable_seq_lengths)

    def plan(self, batch: Batch) -> batching.BatchPlan:
        """Which rows each DP rank computes, in which micro-batches and shapes (the same on every rank)."""
        c = self.ctx
        seq_multiple = c.tp if c.sequence_parallel else 1
        lengths = batching.row_lengths(batch)
        if self.assignment == "contiguous":
            return batching.plan_contiguous(lengths, dp=c.dp, micro_batch_size=self.micro_batch_size,
                                            seq_multiple=seq_multiple, fixed_shape=self.shape_rule.fixed_shape)
        return batching.plan_balanced(lengths, dp=c.dp, micro_batch_size=self.micro_batch_size,
                                      max_tokens=self.max_tokens_per_micro_batch, seq_multiple=seq_multiple,
                                      cost=self.cost, rule=self.shape_rule)

    def _local(self, batch: Batch, required: tuple[str, ...] = ()):
        """(plan, this rank's micro-batches, B, T) of a validated batch on the training device."""
        if isinstance(batch, dict):
            if "routes" in batch:
                if not self.routing:  # the critic (or a dense actor) routes by itself
                    batch = {k: v for k, v in batch.items() if k != "routes"}
                else:
                    self._check_routes(batch["routes"])
            # Routes stay on the host; a micro-batch's go to the device for its forward only (routing_replay.py).
            # The whole batch's would be B x T x layers x topk bytes on every rank: 6 GiB at 128 rows of 128K
            # tokens x 48 layers x top-8.
            batch = {k: v if k == "routes" else v.to(self.ctx.device) for k, v in batch.items()}
        b, t = batching.validate_batch(batch, required=required)
        plan = self.plan(batch)
        return plan, batching.micro_batches(batch, plan, self.ctx.dp_rank), b, t

    def _gather_rows(self, local: list[torch.Tensor] | None, plan: batching.BatchPlan, b: int) -> torch.Tensor:
        """[B, cols] outputs on every rank, rows in the batch's order. The last pipeline stage holds
        this DP rank's rows (identical across its TP ranks): all-gathered over DP at the longest
        rank's row count, put back in place by the plan, then broadcast over the pipeline group."""
        c = self.ctx
        counts = [len(plan.rows_of(r)) for r in range(c.dp)]
        most = max(counts)
        full = torch.zeros((b, plan.cols), dtype=torch.float32, device=c.device)
        if c.is_last_stage:
            mine = torch.cat([o[:len(s.rows)] for o, s in zip(local, plan.per_rank[c.dp_rank])], dim=0)
            mine = torch.nn.functional.pad(mine.float(), (0, 0, 0, most - mine.shape[0]))
            if c.dp > 1:
                gathered = torch.empty((c.dp * most, plan.cols), dtype=torch.float32, device=c.device)
                dist.all_gather_into_tensor(gathered, mine.contiguous(), group=c.dp_group)
            else:
                gathered = mine
            for r in range(c.dp):
                rows = plan.rows_of(r)
                if rows:
                    idx = torch.tensor(rows, dtype=torch.long, device=c.device)
                    full.index_copy_(0, idx, gathered[r * most:r * most + len(rows)])
        if c.pp > 1:
            dist.broadcast(full, src=c.last_stage_rank, group=c.pp_group)
        return full

    def _check_routes(self, routes: torch.Tensor) -> None:
        s = self.spec
        want = (s.num_layers, s.moe_topk)
        if routes.dim() != 4 or tuple(routes.shape[2:]) != want or routes.dtype.is_floating_point:
            raise ValueError(f"batch['routes'] is {routes.dtype} {tuple(routes.shape)}; this model routes "
                             f"[B, T, layers, topk] = [B, T, {want[0]}, {want[1]}] (integer expert id + 1)")
        if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) > s.num_experts):
            raise ValueError(f"batch['routes'] names experts outside 0..{s.num_experts - 1}")

    def _routing_begin(self, batch: Batch):
        """The routers' mode for one schedule: None when the batch has no routes (free routing)."""
        if not self.routing or "routes" not in batch:
            return None
        self.routing.begin(self.replay_routes)
        return self.routing

    def _routing_agreement(self, routing) -> dict[str, float]:
        """Shares of routed token x layer top-k sets where the trainer's own choice (and the set the
        forward used) equals the engine's, over every rank (a collective every rank of an MoE actor joins,
        a pipeline stage without routers included; with SP each token is counted on one TP rank). {} when
        the batch had no routes."""
        if routing is None:
            return {}
        counts = routing.end(self.ctx.device)
        dist.all_reduce(counts)
        if counts[2] == 0:
            return {}
        return {"moe/routing_agreement": float(counts[0] / counts[2]),
                "moe/routing_agreement_used": float(counts[1] / counts[2])}

    def _forward_all(self, batch: Batch, role: str) -> torch.Tensor:
        if self.role != role:
            raise RuntimeError(f"this engine is a {self.role}; {'logprobs' if role == 'actor' else 'values'}() "
                               f"needs a {role} engine")
        self._require("params")
        plan, micro, b, t = self._local(batch)
        self.ddp.eval()
        routing = self._routing_begin(batch) if role == "actor" else None
        outs = fwd.forward_outputs(role, self.chunks, micro, plan.cols, vocab_size=self.spec.vocab_size,
                                   routing=routing)
        if routing is not None:
            self.last_routing_agreement = self._routing_agreement(routing)
        full = self._gather_rows(outs if self.ctx.is_last_stage else None, plan, b)
        # The plan is as wide as the longest real row; the batch may carry padding columns past it.
        full = torch.nn.functional.pad(full, (0, max(t - full.shape[1], 0)))[:, :t]
        mask = batch["attention_mask"]
        # Back where the caller's batch lives (the trainer's batches are host tensors: GAE and the
        # log-prob checks mix these outputs with them; on a GPU `full` is on the GPU).
        return (full * mask.to(full.device).to(full.dtype)).to(mask.device)

    # ------------------------------------------------------------------ public API
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32: log p(tokens[t] | tokens[<t]) at position t; 0 at t=0 and on padding."""
        return self._forward_all(batch, "actor")

    def values(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32: critic value of the state ending at token t, at position t (0 on padding)."""
        return self._forward_all(batch, "critic")

    def train_step(self, batch: Batch, loss_fn: fwd.LossFn) -> StepResult:
        """One optimizer step over the whole batch (all micro-batches, all DP ranks).

        `loss_fn(output [b, T'], micro_batch, loss_denominator) -> (loss, metrics)` where output is
        log-probs (actor) or values (critic) and loss_denominator is the global action-token count
        (a 0-dim float tensor); see forward.py for why this yields an exact global token-mean. The
        actor's micro-batch also carries the differentiable `entropy` [b, T'] (forward.py).
        A non-finite loss or grad norm skips the update (grads zeroed, params and Adam state
        untouched) and returns skipped=True.
        """
        self._require()
        plan, micro, _, _ = self._local(batch, required=("action_mask",))
        denominator = batch["action_mask"].float().sum().clamp(min=1.0).to(self.ctx.device)
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        routing = self._routing_begin(batch)
        store = fwd.run_schedule(self.chunks, micro, plan.cols,
                                 fwd.make_train_loss_func(self.role, loss_fn, denominator,
                                                          vocab_size=self.spec.vocab_size),
                                 forward_only=False, role=self.role, routing=routing)
        t1 = time.perf_counter()
        metrics = fwd.reduce_step_metrics(store, self.ctx)
        metrics.update(self._routing_agreement(routing))
        bad = torch.tensor([0.0 if math.isfinite(metrics["loss"]) else 1.0], device=self.ctx.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank must take the same branch
        outcome = safe_optimizer_step(self.optimizer, clip_grad=self.optim_config.clip_grad,
                                      loss_is_finite=bool(bad.item() == 0.0), param_names=self._param_names,
                                      norm_groups=self.grad_norm_groups or None)
        if not outcome.skipped:
            self.scheduler.step(increment=1)
            self.state_version += 1
        # Wall seconds of the forward+backward schedule (incl. the DDP grad reduction) and of the
        # optimizer step (grad norm, clipping, update, param all-gather).
        metrics["time/fwd_bwd_s"] = t1 - t0
        metrics["time/optimizer_s"] = time.perf_counter() - t1
        for g, v in outcome.group_norms.items():
            metrics[f"grad_norm/{g}"] = v
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        # How well the plan spread the batch (megatron/batching.py::plan_stats), as verl logs its balance.
        stats = batching.plan_stats(plan, batching.row_lengths(batch), self.cost)
        metrics["plan/compute_ratio"] = stats.compute_ratio
        metrics["plan/padding_fraction"] = stats.padding_fraction
        metrics["plan/forward_calls"] = float(max(stats.forward_calls))
        return StepResult(loss=metrics["loss"], grad_norm=outcome.grad_norm, metrics=metrics, skipped=outcome.skipped)

    def export_hf_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights under HF names in buckets of <= bucket_bytes, yielded on global rank 0."""
        from megatron_sao.weights.export import export_hf_weights

        self._require("params")
        return export_hf_weights(self.module, self.spec, self.ctx, bucket_bytes=bucket_bytes)

    def export_hf_weights_every_rank(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The same buckets yielded on *every* rank (pp=1): what an in-process engine shard loads."""
        from megatron_sao.weights.export import export_hf_weights

        self._require("params")
        return export_hf_weights(self.module, self.spec, self.ctx, bucket_bytes=bucket_bytes, every_rank=True)

    # ------------------------------------------------------------------ colocated placement
    def offload(self, parts=("params", "grads", "optimizer")):
        """Release `parts` of this engine's GPU state to host memory (megatron/offload.py)."""
        return self._offload.offload(parts)

    def onload(self, parts=("params", "grads", "optimizer")):
        """Bring `parts` back (bit-exact: params and optimizer state; grads as zeros)."""
        return self._offload.onload(parts)

    def resident(self, *parts: str) -> bool:
        """Whether `parts` (default: all) are on the device."""
        return self._offload.resident(*parts)

    def device_bytes(self) -> dict[str, int]:
        """Bytes of params / grads / optimizer state on the device now."""
        return self._offload.device_bytes()

    @torch.no_grad()
    def set_value_head_bias(self, value: float) -> None:
        """Set the critic's value-head bias to `value` (collective: every rank calls it with the same
        value), in the model and in the optimizer's main copy (the fp32 master of a bf16 run, or this
        rank's shard under the distributed optimizer), so the next step updates from it."""
        if self.role != "critic":
            raise RuntimeError(f"set_value_head_bias: this engine is a {self.role}")
        if not math.isfinite(value):
            raise ValueError(f"set_value_head_bias: value must be finite, got {value!r}")
        self._require("params", "optimizer")
        for p in self.module.parameters():
            if self._param_names.get(id(p)) == "value_head.bias":
                p.fill_(value)
        from megatron_sao.megatron.optimizer import model_main_param_pairs, sub_optimizers

        for opt in sub_optimizers(self.optimizer):
            for model_p, main_p in model_main_param_pairs(opt):
                if self._param_names.get(id(model_p)) == "value_head.bias":
                    main_p.fill_(value)

    def save(self, path: str, *, asynchronous: bool = False):
        """Model + optimizer + scheduler as a distributed checkpoint in `path` (an existing, empty
        directory; megatron/dist_state.py). Asynchronous: returns the AsyncRequest that writes it."""
        from megatron_sao.megatron import dist_state

        return dist_state.save(self, path, asynchronous=asynchronous)

    def load(self, path: str) -> dict:
        """Restore what `save` wrote at any layout (resharded), or a per-rank checkpoint of the old format
        at its own layout. Returns the checkpoint's record (format, layout it was saved at, ...)."""
        from megatron_sao.megatron import dist_state

        return dist_state.load(self, path)
