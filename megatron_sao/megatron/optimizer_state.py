"""The optimizer's state in model space, one form for every optimizer kind: what makes a checkpoint reshardable.

For every trainable model tensor with global key K the checkpoint holds three tensors of K's shape:

    optimizer.state.param.K        the fp32 main weight (the model weight itself when training in fp32)
    optimizer.state.exp_avg.K      Adam's first moment
    optimizer.state.exp_avg_sq.K   Adam's second moment

and one Adam step count for the engine. Each is sharded exactly like K (same TP/EP slices, same global
offsets, same replica ids), so dist_checkpointing reads it back at any TP / PP / EP / ETP / DP.

Megatron's distributed optimizer writes this form itself: `fully_reshardable` (Megatron-LM PR 7162) gathers
its flat per-DP-rank buffers and cuts them back into model-shaped tensors under these keys, and on load
every rank reads its model shard's tensors whole and keeps its own DP slice. The plain optimizers (the
engine uses them where DP has one rank, `optimizer.effective_for`) have sharded state dicts of their own
whose moments carry the same keys but whose main weight does not (`fp32_param`, or none in fp32) and whose
non-tensor part is nested differently, so a checkpoint of one kind does not load into the other (measured:
distributed DP 2 -> plain DP 1 fails in `_filter_and_reorder_param_groups` with KeyError 'pre_wd_mult').
Here the plain optimizers write and read the distributed optimizer's keys through megatron's own
`make_sharded_optimizer_tensor`, and the non-tensor part (param groups: LR, weight decay) is never read back
from a checkpoint: it is the live optimizer's own (the LR scheduler sets the LR from its restored step).
"""

from __future__ import annotations

import torch

from megatron_sao.megatron.optimizer import model_main_param_pairs, sub_optimizers

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
PREFIX = "optimizer.state"
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def _torch_adam(inner) -> bool:
    """torch's Adam/AdamW keep the step per parameter in `state`; TE's and apex's FusedAdam per param group."""
    return isinstance(inner, torch.optim.Adam)


def ensure_state(optimizer) -> None:
    """Allocate Adam's state where no step has made it yet (a critic-warm-up actor, a fresh engine about
    to load): zero moments and step 0, exactly what Adam starts from, so nothing changes for the next step."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
        if _torch_adam(inner):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def adam_step(optimizer) -> int:
    """Adam's step count (the same for every parameter and every sub-optimizer: they step together)."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        for s in inner.state.values():
            if "step" in s:
                return int(s["step"])
        for g in inner.param_groups:
            if "step" in g:
                return int(g["step"])
    return 0


def _set_step(inner, step: int) -> None:
    if _torch_adam(inner):
        for s in inner.state.values():
            s["step"] = torch.tensor(float(step), dtype=torch.float32)
    else:
        for g in inner.param_groups:
            g["step"] = step


def _by_param(model_sd: dict) -> dict:
    """Model tensor -> its ShardedTensor (or factory); the sharded state dict holds the Parameters themselves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {sh.data: sh for sh in nested_values(model_sd) if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}


def _plain_state(opt, by_param: dict) -> dict[int, dict]:
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    inner = opt.optimizer
    out = {}
    for i, (model_p, main_p) in enumerate(model_main_param_pairs(opt)):
        sh = by_param.get(model_p)
        if sh is None:
            raise ValueError(f"optimizer parameter {tuple(model_p.shape)} is not in the model's sharded state dict")
        state = inner.state[main_p]
        tensors = {"param": main_p.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        out[i] = {k: make_sharded_optimizer_tensor(sh, t, prefix=f"{PREFIX}.{k}") for k, t in tensors.items()}
    return out


def sharded_optimizer_state(optimizer, model_sd: dict, *, loading: bool) -> dict[int, dict]:
    """{sub-optimizer: {parameter index: {param/exp_avg/exp_avg_sq: ShardedTensor}}} (the keys are global, so
    the nesting only has to match between this call and `load_optimizer_state` of the same engine).
    Collective for the distributed optimizer (its save gathers the DP shards)."""
    ensure_state(optimizer)
    by_param = _by_param(model_sd)
    out = {}
    for i, opt in enumerate(sub_optimizers(optimizer)):
        if _is_distributed(opt):
            out[i] = opt.sharded_param_state_fully_reshardable(model_sd, is_loading=loading, metadata=FULLY_RESHARDABLE)
        else:
            out[i] = _plain_state(opt, by_param)
    return out


@torch.no_grad()
def load_optimizer_state(optimizer, loaded: dict, step: int) -> None:
    """Put what `dist_checkpointing.load` returned for `sharded_optimizer_state(..., loading=True)` into the
    live optimizer, with Adam's step count."""
    for i, opt in enumerate(sub_optimizers(optimizer)):
        inner = opt.optimizer
        if _is_distributed(opt):
            groups = [{k: v for k, v in g.items() if k != "params"} | {"step": step}
                      for g in inner.state_dict()["param_groups"]]
            opt.load_state_dict({"optimizer": {"param_groups": groups}, "param_state": loaded[i],
                                 "param_state_sharding_type": FULLY_RESHARDABLE["distrib_optim_sharding_type"]})
        else:
            for j, (_, main_p) in enumerate(model_main_param_pairs(opt)):
                src, state = loaded[i][j], inner.state[main_p]
                main_p.copy_(src["param"])
                state["exp_avg"].copy_(src["exp_avg"])
                state["exp_avg_sq"].copy_(src["exp_avg_sq"])
        _set_step(inner, step)
