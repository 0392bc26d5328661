"""Rollout routing replay (R3) for the MoE actor, through Megatron-Core's router replay.

The engine that sampled a trajectory records which experts it routed every token to
(`Trajectory.routed_experts`); the batch carries them as `routes` [B, T, layers, topk] holding
expert id + 1, 0 where there is no engine route (module docstring of `trajectory.py`). Here each
micro-batch's routes become the replay targets of the actor's routers, so the trainer's forward
uses the engine's experts: the router's scores are gathered at those experts (their probabilities
and gradients are the trainer's own), only the choice is replayed.

Megatron-Core 0.16.1 (`moe_enable_routing_replay`, `transformer/moe/router_replay.py`) gives every
router a `RouterReplay` whose `get_replay_topk` the top-k routing calls; its actions are
REPLAY_FORWARD (use the target set for this micro-batch) and REPLAY_BACKWARD (activation recompute
during the backward pass pops the targets in the order the forwards set them, so 1F1B pipelining and
recompute replay the same routes). `MeasuredRouterReplay` keeps that protocol and adds two things:
- tokens without an engine route (the last token, trailing observations, padding) route freely
  (the trainer's own top-k), as verl's replay mask does; no scored log-prob depends on them;
- every forward counts, per token x layer with an engine route, whether the trainer's own top-k
  set equals the engine's (`moe/routing_agreement`, measured with replay on or off) and whether the
  set the forward used does (`moe/routing_agreement_used`: 1.0 with replay on, the same as the
  first with it off).

Each router sees its own tokens: under sequence parallelism the TP rank's sequence chunk, flattened
[s, b] (Megatron's hidden layout), under PP its stage's layers (by the router's global layer number),
under EP the DP rank's rows. So the target of a router is sliced from the micro-batch's routes here,
and nothing else in the engine changes. The critic never gets routes: it is another model and
routes by its own router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def _router_replay_types():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def make_measured_router_replay():
    """A `MeasuredRouterReplay` (the class is built lazily: megatron-core is imported on first use)."""
    RouterReplay, RouterReplayAction = _router_replay_types()

    class MeasuredRouterReplay(RouterReplay):
        """Megatron-Core's RouterReplay + free routing where there is no target + agreement counts."""

        def __init__(self) -> None:
            super().__init__()
            # Not a process-wide instance: the actor addresses its own routers (the critic's, or a
            # second model's, must not take these targets), and a dropped model must not stay referenced.
            RouterReplay.global_router_replay_instances.remove(self)
            self.replay = False  # False: measure only (the trainer routes freely)
            self.recomputed = 0  # forwards replayed by activation recompute (REPLAY_BACKWARD), for tests
            self.agree = torch.zeros((), dtype=torch.int64)  # tensors: no device sync per layer
            self.used = torch.zeros((), dtype=torch.int64)  # the routes the forward used equal the engine's
            self.total = torch.zeros((), dtype=torch.int64)

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            action = self.router_replay_action
            if action == RouterReplayAction.REPLAY_FORWARD:
                target = self.target_topk_idx
            elif action == RouterReplayAction.REPLAY_BACKWARD and self.replay_backward_list:
                target = self.replay_backward_list.pop(0)
                self.recomputed += 1
            else:
                return default_compute_topk(scores, topk, num_groups, group_topk)
            own_probs, own = default_compute_topk(scores, topk, num_groups, group_topk)
            target = target.to(scores.device)
            if target.shape != own.shape:
                raise RuntimeError(f"routing replay: targets {tuple(target.shape)} for a router that sees "
                                   f"{tuple(own.shape)} (tokens x topk): routes are sliced wrongly")
            has = target[:, 0] >= 0
            chosen = torch.where(has[:, None], target, own) if self.replay else own
            if action == RouterReplayAction.REPLAY_FORWARD:  # recompute repeats the forward: count once
                engine = target.sort(dim=1).values
                same = (own.sort(dim=1).values == engine).all(dim=1) & has
                used = (chosen.sort(dim=1).values == engine).all(dim=1) & has
                self.agree = self.agree.to(same.device) + same.sum()
                self.used = self.used.to(same.device) + used.sum()
                self.total = self.total.to(same.device) + has.sum()
            if not self.replay:
                return own_probs, own
            return scores.gather(1, chosen), chosen

    return MeasuredRouterReplay()


def install_router_replay(model: nn.Module) -> list:
    """Give every top-k router of `model` a MeasuredRouterReplay; returns (layer_number - 1, replay)
    pairs in layer order. [] for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    RouterReplay, _ = _router_replay_types()
    out = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            core = module.router_replay  # moe_enable_routing_replay's own instance, replaced
            if core is not None and core in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(core)
            if module.config.moe_router_fusion:
                raise ValueError("routing replay needs moe_router_fusion=False (the fused top-k bypasses the replay)")
            if module.layer_number is None:
                raise RuntimeError("a TopKRouter without a layer number: cannot tell which routes are its own")
            module.router_replay = make_measured_router_replay()
            out.append((module.layer_number - 1, module.router_replay))
    return sorted(out, key=lambda p: p[0])


@dataclass
class RouteSlice:
    """Which tokens this rank's routers see: the TP rank's chunk of the sequence under SP."""

    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False


def router_targets(routes: torch.Tensor, layer: int, where: RouteSlice) -> torch.Tensor:
    """int64 [s_local * b, topk] expert ids (-1 = no engine route) of `layer` for one micro-batch's
    `routes` [b, s, layers, topk] (expert id + 1), in the router's token order ([s, b] flattened)."""
    b, s, layers, topk = routes.shape
    if not 0 <= layer < layers:
        raise ValueError(f"routing replay: the batch routes {layers} layers, the model has layer {layer + 1}")
    r = routes[:, :, layer, :]
    if where.sequence_parallel and where.tp > 1:
        if s % where.tp:
            raise ValueError(f"routing replay: {s} columns do not split over TP={where.tp}")
        chunk = s // where.tp
        r = r[:, where.tp_rank * chunk:(where.tp_rank + 1) * chunk]
    return (r.transpose(0, 1).reshape(-1, topk).to(torch.int64) - 1).contiguous()


class RoutingReplay:
    """The actor engine's handle on its routers: set a micro-batch's targets, count agreement.
    ``moe``: the model routes (an MoE actor), whether or not this rank's pipeline stage holds a router:
    every rank of such a model takes the batch's routes and joins the agreement's all-reduce (a stage of
    dense layers with no router, beside stages with routers, would otherwise skip it and the others hang).
    ``recompute``: the engine recomputes activations in the backward pass (the forwards are re-run);
    ``device``: where the routers run (a micro-batch's routes come from the host, see before_forward)."""

    def __init__(self, routers: list, where: RouteSlice, recompute: bool = False, device=None,
                 moe: bool | None = None) -> None:
        self.routers = routers
        self.where = where
        self.recompute = recompute
        self.device = device
        self.replay = False
        self.moe = bool(routers) if moe is None else moe

    def __bool__(self) -> bool:
        """True for an MoE actor on every rank (see ``moe``), with or without routers on this stage."""
        return self.moe

    def begin(self, replay: bool) -> None:
        """Before a schedule: replay (True) or only measure (False); counts start at 0."""
        self.replay = replay
        for _, r in self.routers:
            r.clear_indices()
            r.clear_router_replay_action()
            r.replay = replay
            r.agree, r.used, r.total = (torch.zeros((), dtype=torch.int64) for _ in range(3))

    def before_forward(self, mb: dict) -> None:
        """Targets of this micro-batch (REPLAY_FORWARD), or free routing when it has no routes."""
        _, Action = _router_replay_types()
        routes = mb.get("routes")
        if routes is not None and self.device is not None:
            # The batch's routes are kept on the host; this micro-batch's go over now, in their compact dtype.
            routes = routes.to(self.device)
        for layer, r in self.routers:
            if routes is None:
                r.clear_router_replay_action()
                continue
            r.set_target_indices(router_targets(routes, layer, self.where))
            if not (self.recompute and torch.is_grad_enabled()):
                # Nothing re-runs this forward, and Megatron's list (set_target_indices appends) would keep
                # every micro-batch's int64 targets to the end of the schedule: 8 bytes per token x layer x topk.
                r.replay_backward_list.clear()
            r.set_router_replay_action(Action.REPLAY_FORWARD)

    def after_forward(self) -> None:
        """Activation recompute in the backward pass pops the targets in forward order."""
        _, Action = _router_replay_types()
        if torch.is_grad_enabled():
            for _, r in self.routers:
                if r.router_replay_action is not None:
                    r.set_router_replay_action(Action.REPLAY_BACKWARD)

    def end(self, device) -> torch.Tensor:
        """After a schedule: float64 [own agrees, used agrees, total] token x layer counts of this rank, on
        `device` (for the all-reduce every rank joins; zeros on a stage without routers); targets dropped."""
        counts = torch.zeros(3, dtype=torch.float64, device=device)
        for _, r in self.routers:
            counts += torch.stack([r.agree.to(device), r.used.to(device), r.total.to(device)]).double()
        for _, r in self.routers:
            r.clear_indices()
            r.clear_router_replay_action()
        return counts
