"""Routed experts in the trajectory (MoE routing replay): stitched per turn, validated, compact, collated, and
kept bit-exactly in trajectory files (buffer files and resume use the same format)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_sao.trajectory import (
    Trajectory,
    TrajectoryBuilder,
    TrajectoryError,
    TrajectoryFileError,
    collate_padded,
    load_trajectories,
    route_dtype,
    save_trajectories,
    trajectories_equal,
)


def routes(n: int, layers: int = 2, topk: int = 2, experts: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, layers, experts), generator=g).argsort(-1)[..., :topk].to(route_dtype(experts))


def two_turns() -> Trajectory:
    """prompt 3 + action 2 + observation 2 + action 3 = 10 tokens; turn 1 routes 0..3, turn 2 routes 4..8."""
    b = TrajectoryBuilder(prompt_id="p")
    b.add_prompt([1, 2, 3])
    b.add_routes(0, routes(4, seed=1))
    b.add_action([4, 5], [-0.1, -0.2], 0)
    b.add_observation([6, 7])
    b.add_routes(b.routes_covered, routes(5, seed=2))
    b.add_action([8, 9, 10], [-0.3, -0.4, -0.5], 1)
    return b.finish("terminated", reward=1.0)


def test_route_dtype_is_the_smallest_that_holds_the_expert_count():
    assert route_dtype(4) == route_dtype(256) == torch.uint8
    assert route_dtype(257) == route_dtype(32768) == torch.int16
    assert route_dtype(32769) == torch.int32


def test_builder_stitches_turns_into_t_minus_one_routes():
    t = two_turns()
    assert t.routed_experts.shape == (t.length - 1, 2, 2) and t.routed_experts.dtype == torch.uint8
    assert torch.equal(t.routed_experts, torch.cat([routes(4, seed=1), routes(5, seed=2)]))


def test_builder_refuses_a_gap_or_an_overlap():
    b = TrajectoryBuilder()
    b.add_prompt([1, 2, 3])
    b.add_routes(0, routes(2))
    with pytest.raises(TrajectoryError, match="routes start at token 3"):
        b.add_routes(3, routes(1))
    with pytest.raises(TrajectoryError, match="routes start at token 1"):
        b.add_routes(1, routes(1))
    with pytest.raises(TrajectoryError, match="layers / topk changed"):
        b.add_routes(2, routes(1, layers=3))


@pytest.mark.parametrize("bad, needle", [
    (lambda r: r[:3], "must cover every token before the last action token"),
    (lambda r: torch.cat([r, r[:1]]), "at most T - 1"),
    (lambda r: r.float(), "tensor of"),
    (lambda r: torch.cat([r[:, :, :1], r[:, :, :1]], dim=2), "names one expert twice"),
    (lambda r: r.to(torch.int16) - 1, "negative expert ids"),
])
def test_validation_names_what_is_wrong_with_routes(bad, needle):
    t = two_turns()
    with pytest.raises(TrajectoryError, match=needle):
        Trajectory(tokens=t.tokens, action_mask=t.action_mask, rollout_logprobs=t.rollout_logprobs,
                   versions=t.versions, spans=t.spans, reward=t.reward, status=t.status,
                   routed_experts=bad(t.routed_experts))


def test_a_failed_episode_keeps_no_routes():
    b = TrajectoryBuilder()
    b.add_prompt([1, 2, 3])
    b.add_routes(0, routes(2))
    assert b.finish("failed", error="boom").routed_experts is None


def test_collate_encodes_expert_plus_one_and_zero_where_there_is_no_route():
    with_routes = two_turns()
    without = Trajectory(tokens=[1, 2, 3], action_mask=[False, True, True], rollout_logprobs=[0, -0.1, -0.2],
                         versions=[-1, 0, 0], spans=[(0, 1, "prompt"), (1, 3, "action")], reward=0.0,
                         status="terminated")
    batch = collate_padded([without, with_routes])
    assert batch.routes.shape == (2, 10, 2, 2) and batch.routes.dtype == torch.uint8
    assert int(batch.routes[0].abs().sum()) == 0  # a row without routes routes freely
    assert torch.equal(batch.routes[1, :9], with_routes.routed_experts + 1)
    assert int(batch.routes[1, 9].abs().sum()) == 0  # the last token has no route
    assert collate_padded([without]).routes is None
    wide = two_turns()
    wide.routed_experts = wide.routed_experts.to(torch.int16) + 255  # expert 255 + 1 needs int16
    assert collate_padded([wide]).routes.dtype == torch.int16


def test_files_keep_routes_bit_exactly_and_mixed_with_unrouted_trajectories(tmp_path):
    without = Trajectory(tokens=[1, 2], action_mask=[False, True], rollout_logprobs=[0, -0.1], versions=[-1, 0],
                         spans=[(0, 1, "prompt"), (1, 2, "action")], reward=0.0, status="terminated")
    wide = two_turns()
    wide.routed_experts = wide.routed_experts.to(torch.int16) + 300  # a model with > 256 experts
    trajs = [two_turns(), without, wide]
    path = tmp_path / "t.safetensors"
    save_trajectories(path, trajs)
    back = load_trajectories(path)
    assert back[1].routed_experts is None
    assert back[0].routed_experts.dtype == back[2].routed_experts.dtype == torch.int16  # one tensor: the widest
    assert torch.equal(back[0].routed_experts, trajs[0].routed_experts.to(torch.int16))
    assert torch.equal(back[2].routed_experts, wide.routed_experts)
    single = tmp_path / "one.safetensors"
    save_trajectories(single, [trajs[0]])
    assert trajectories_equal(load_trajectories(single)[0], trajs[0])  # uint8 stays uint8


def _edit(path, out, **changes):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    for k, v in changes.items():
        if k == "meta":
            meta = {**meta, "meta": json.dumps(v(json.loads(meta["meta"])))}
        elif v is None:
            tensors.pop(k)
        else:
            tensors[k] = v(tensors[k])
    save_file(tensors, str(out), metadata=meta)


@pytest.mark.parametrize("changes, needle", [
    (dict(route_offsets=None), "without its pair"),
    (dict(routed_experts=lambda r: r[:-1]), "route_offsets run"),
    (dict(routed_experts=lambda r: r.float()), "routed_experts is torch.float32"),
    (dict(routed_experts=None, route_offsets=None), "routes=true but the file has no routed_experts"),
    (dict(meta=lambda m: [{**m[0], "routes": False}]), "routes=false but 9 route rows"),
    (dict(routed_experts=lambda r: r[:-2], route_offsets=lambda o: o - torch.tensor([0, 2])),
     "must cover every token before the last action token"),
])
def test_load_rejects_broken_route_tensors_naming_the_file(tmp_path, changes, needle):
    good = tmp_path / "good.safetensors"
    save_trajectories(good, [two_turns()])
    bad = tmp_path / "bad.safetensors"
    _edit(good, bad, **changes)
    with pytest.raises(TrajectoryFileError, match=needle) as e:
        load_trajectories(bad)
    assert str(bad) in str(e.value)


def test_dense_actor_refuses_routing_replay():
    from megatron_sao.config import ConfigError, load_config
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.presets import tiny_hf_config
    from megatron_sao.trainer.components import check_routing_replay

    cfg = load_config(None, ["rollout.routing_replay=true"])
    with pytest.raises(ConfigError, match="rollout.routing_replay: .* dense model"):
        check_routing_replay(cfg, model_spec_from_hf(tiny_hf_config("qwen3")))
    check_routing_replay(cfg, model_spec_from_hf(tiny_hf_config("qwen3_moe")))  # an MoE actor is fine


def test_buffer_resume_restores_routes_and_sets_aside_a_damaged_route_file(tmp_path, caplog):
    """The buffer persists every trajectory on arrival; a resumed buffer gets the routes back bit-exactly, and a
    file whose routes were damaged is not restored (nothing is trained on half a route): it is set aside under
    buffer/set_aside/ with its name and the reason in the log, like any buffer file that does not parse."""
    from megatron_sao.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(batch_size=1, max_staleness=4, directory=tmp_path / "buffer")
    traj = two_turns()
    buf.put(traj)
    (back,) = TrajectoryBuffer(batch_size=1, max_staleness=4, directory=tmp_path / "buffer").restore()
    assert trajectories_equal(back, traj)
    (path,) = (tmp_path / "buffer").glob("*.safetensors")
    _edit(path, path.with_suffix(".tmp"), routed_experts=lambda r: r[:-2],
          route_offsets=lambda o: o - torch.tensor([0, 2]))
    path.with_suffix(".tmp").replace(path)
    with caplog.at_level("WARNING", logger="megatron_sao.buffer"):
        assert TrajectoryBuffer(batch_size=1, max_staleness=4, directory=tmp_path / "buffer").restore() == []
    assert not path.exists() and (tmp_path / "buffer" / "set_aside" / path.name).exists()
    assert path.name in caplog.text and "must cover every token before the last action token" in caplog.text


def test_resume_sets_aside_routes_this_actor_cannot_replay(tmp_path, caplog):
    """Routes of another model (other [layers, topk], or experts this actor does not have) in a restored buffer
    file: the trainer's check names what differs and the file is set aside, instead of the train step
    refusing the batch; fitting routes and unrouted trajectories are restored."""
    from megatron_sao.buffer import TrajectoryBuffer

    traj = two_turns()  # [R, 2 layers, top-2], experts < 8
    assert traj.routes_problem(2, 2, 8) is None
    assert "[tokens, 2, 2] (layers, topk); this actor routes [tokens, 4, 2]" in traj.routes_problem(4, 2, 8)
    top = int(traj.routed_experts.max())
    assert f"its routes name expert {top}; this actor has {top} experts" in traj.routes_problem(2, 2, top)
    buf = TrajectoryBuffer(batch_size=1, max_staleness=4, directory=tmp_path / "buffer")
    buf.put(traj)
    with caplog.at_level("WARNING", logger="megatron_sao.buffer"):
        restored = TrajectoryBuffer(batch_size=1, max_staleness=4, directory=tmp_path / "buffer").restore(
            unusable=lambda t: t.routes_problem(4, 2, 8))
    assert restored == [] and len(list((tmp_path / "buffer" / "set_aside").glob("*.safetensors"))) == 1
    assert "cannot be trained on" in caplog.text and "this actor routes [tokens, 4, 2]" in caplog.text
