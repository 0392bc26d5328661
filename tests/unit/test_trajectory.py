"""The Trajectory contract: validation errors, builder, collation, lossless on-disk format."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from megatron_sao.trajectory import (
    Span,
    Trajectory,
    TrajectoryBuilder,
    TrajectoryError,
    TrajectoryFileError,
    collate_padded,
    load_trajectories,
    save_trajectories,
    trajectories_equal,
)


def _two_turn(status="terminated", reward=1.0, **kw):
    b = TrajectoryBuilder(prompt_id="p0", env="toy")
    b.add_prompt([5, 6, 7])
    b.add_action([10, 11], [-0.5, -0.25], 3)
    b.add_observation([20, 21, 22])
    b.add_action([12, 2], [-1.0, -0.125], [3, 4])
    return b.finish(status, reward=reward, **kw)


def test_builder_makes_a_consistent_trajectory():
    t = _two_turn()
    assert t.tokens.tolist() == [5, 6, 7, 10, 11, 20, 21, 22, 12, 2]
    assert t.action_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert t.rollout_logprobs.tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0, -0.125]
    assert t.versions.tolist() == [-1, -1, -1, 3, 3, -1, -1, -1, 3, 4]
    assert [s.kind for s in t.spans] == ["prompt", "action", "observation", "action"]
    assert t.num_turns == 2 and t.last_action_index == 9 and t.min_version() == 3
    assert t.turn_ids().tolist() == [-1, -1, -1, 0, 0, -1, -1, -1, 1, 1]


def _raw(**over):
    fields = dict(tokens=[1, 2, 3], action_mask=[False, True, True], rollout_logprobs=[0.0, -1.0, -2.0],
                  versions=[-1, 0, 0], spans=[Span(0, 1, "prompt"), Span(1, 3, "action")], reward=1.0,
                  status="terminated")
    fields.update(over)
    return Trajectory(**fields)


@pytest.mark.parametrize("over, needle", [
    (dict(action_mask=[False, True]), "action_mask has length 2"),
    (dict(rollout_logprobs=[-0.3, -1.0, -2.0]), "nonzero on 1 non-action"),
    (dict(versions=[0, 0, 0]), "versions must be -1 on non-action"),
    (dict(rollout_logprobs=[0.0, 0.5, -2.0]), "finite and <= 0"),
    (dict(rollout_logprobs=[0.0, float("nan"), -2.0]), "finite and <= 0"),
    (dict(status="truncated"), "needs a bootstrap"),
    (dict(bootstrap=0.3), "only allowed on truncated"),
    (dict(status="done"), "status 'done'"),
    (dict(spans=[Span(0, 2, "prompt"), Span(2, 3, "action")]), "prompt span but covers action"),
    (dict(spans=[Span(0, 1, "prompt")]), "spans end at 1"),
    (dict(status="failed"), "must record its error"),
    (dict(status="failed", error="boom"), "reward 0"),
    (dict(action_mask=[False, False, False], rollout_logprobs=[0, 0, 0], versions=[-1, -1, -1],
          spans=[Span(0, 3, "prompt")]), "at least one action token"),
    (dict(reward=math.inf), "not finite"),
])
def test_validation_rejects_inconsistent_input(over, needle):
    with pytest.raises(TrajectoryError, match=needle):
        _raw(**over)


def test_builder_rejects_mismatched_action_lengths():
    b = TrajectoryBuilder()
    with pytest.raises(TrajectoryError, match="2 ids, 1 logprobs"):
        b.add_action([1, 2], [-0.1], 0)


def test_truncated_defaults_to_critic_bootstrap_and_failed_is_not_trainable():
    t = _two_turn(status="truncated", reward=0.0)
    assert t.bootstrap == "critic"
    f = _two_turn(status="failed", reward=0.0, error="RuntimeError: env died")
    assert not f.trainable
    with pytest.raises(ValueError, match="failed trajectories cannot be trained"):
        collate_padded([t, f])


def test_collate_padded_places_reward_on_last_action_token():
    a, b = _two_turn(reward=0.5), _two_turn(status="truncated", reward=0.0)
    short = _raw(reward=2.0)
    batch = collate_padded([a, short, b], pad_id=0)
    assert batch.tokens.shape == (3, 10)
    assert batch.rewards[0].nonzero().flatten().tolist() == [9] and batch.rewards[0, 9] == 0.5
    assert batch.rewards[1].tolist() == [0, 0, 2.0] + [0] * 7
    assert batch.attention_mask[1].tolist() == [True] * 3 + [False] * 7
    assert not batch.action_mask[1, 3:].any() and (batch.versions[1, 3:] == -1).all()
    assert batch.bootstrap_from_critic.tolist() == [False, False, True]
    assert batch.lengths.tolist() == [10, 3, 10]


def test_disk_round_trip_is_lossless(tmp_path):
    trajs = [_two_turn(), _two_turn(status="truncated", reward=0.0),
             _two_turn(status="failed", reward=0.0, error="ValueError: bad tool call"), _raw()]
    trajs[0].rollout_logprobs[3] = torch.tensor(-0.1234567891, dtype=torch.float32)  # an odd float32
    trajs[0].info["tool_calls"] = 2
    path = tmp_path / "t.safetensors"
    save_trajectories(path, trajs)
    back = load_trajectories(path)
    assert len(back) == 4 and all(trajectories_equal(x, y) for x, y in zip(trajs, back))
    assert not list(tmp_path.glob("*.tmp-*"))  # atomic write leaves no temp file


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="not a megatron_sao trajectory file"):
        load_trajectories(tmp_path / "x.safetensors")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["action", "observation"]), st.integers(1, 5)), min_size=1, max_size=6),
       st.floats(-3, 3, allow_nan=False))
def test_property_builder_round_trip(segments, reward):
    import os
    import tempfile
    b = TrajectoryBuilder(prompt_id="q")
    b.add_prompt([1, 2])
    b.add_action([3], [-0.5], 0)  # at least one action
    for i, (kind, n) in enumerate(segments):
        if kind == "action":
            b.add_action(list(range(n)), [-0.01 * (k + 1) for k in range(n)], i)
        else:
            b.add_observation([7] * n)
    t = b.finish("terminated", reward=reward)
    assert int(t.action_mask.sum()) == 1 + sum(n for k, n in segments if k == "action")
    assert (t.rollout_logprobs[~t.action_mask] == 0).all()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.safetensors")
        save_trajectories(p, [t])
        assert trajectories_equal(load_trajectories(p)[0], t)


def _raw_file(path, trajs, **edit):
    """A trajectory file written the way save_trajectories does, with some tensors replaced."""
    from safetensors.torch import save_file
    save_trajectories(path, trajs)
    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors.update(edit)
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("edit, needle", [
    (lambda t: {"versions": t["versions"][:-1]}, "length mismatch: versions has"),
    (lambda t: {"offsets": t["offsets"] + torch.tensor([0, 0, 5])}, "offsets run from 0 to"),
    (lambda t: {"offsets": torch.tensor([0, 20, 20])}, "empty or decreasing"),
    (lambda t: {"offsets": t["offsets"][:2]}, "2 offsets for 2 trajectories"),
    (lambda t: {"action_mask": t["action_mask"].float()}, "tensor 'action_mask' is torch.float32"),
])
def test_load_rejects_structurally_broken_files_naming_the_file(tmp_path, edit, needle):
    good = tmp_path / "good.safetensors"
    trajs = [_two_turn(), _two_turn()]
    save_trajectories(good, trajs)
    with safe_open(str(good), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    bad = _raw_file(tmp_path / "bad.safetensors", trajs, **edit(t))
    with pytest.raises(TrajectoryFileError, match=needle) as e:
        load_trajectories(bad)
    assert str(bad) in str(e.value)


def test_load_names_a_truncated_file_and_the_tensor_cut_off(tmp_path):
    path = tmp_path / "t.safetensors"
    save_trajectories(path, [_two_turn()])
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(TrajectoryFileError, match=r"t.safetensors: truncated: tensor '\w+' needs bytes"):
        load_trajectories(path)
    with pytest.raises(TrajectoryFileError, match="no such file"):
        load_trajectories(tmp_path / "missing.safetensors")
