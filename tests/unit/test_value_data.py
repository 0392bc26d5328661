"""Value pretraining's held-out split and its epoch batches (trainer/value_data.py)."""

from dataclasses import dataclass

import pytest

from megatron_sao.trainer.value_data import EpochBatches, split_heldout


@dataclass
class T:
    prompt_id: str
    traj_id: str


def _trajs(prompts: int, per_prompt: int = 1) -> list[T]:
    return [T(f"p{i}", f"p{i}/{j}") for i in range(prompts) for j in range(per_prompt)]


def test_no_trajectory_and_no_prompt_is_on_both_sides():
    trajs = _trajs(100, per_prompt=3)
    train, held = split_heldout(trajs, 0.2, seed=1)
    assert not {t.traj_id for t in train} & {t.traj_id for t in held}
    assert not {t.prompt_id for t in train} & {t.prompt_id for t in held}  # repeats of a prompt stay together
    assert len(train) + len(held) == len(trajs) and len({t.prompt_id for t in held}) == 20


def test_the_split_is_a_function_of_prompt_ids_and_seed():
    a = split_heldout(_trajs(50), 0.3, seed=4)
    b = split_heldout(list(reversed(_trajs(50))), 0.3, seed=4)
    assert {t.prompt_id for t in a[1]} == {t.prompt_id for t in b[1]}
    assert {t.prompt_id for t in a[1]} != {t.prompt_id for t in split_heldout(_trajs(50), 0.3, seed=5)[1]}


def test_both_sides_keep_a_prompt_and_bad_input_is_named():
    train, held = split_heldout(_trajs(2), 0.9, seed=0)
    assert len(train) == len(held) == 1
    with pytest.raises(ValueError, match="at least 2 prompts"):
        split_heldout(_trajs(1, per_prompt=5), 0.2, seed=0)
    with pytest.raises(ValueError, match="fraction"):
        split_heldout(_trajs(5), 1.0, seed=0)


def test_every_item_is_seen_once_per_epoch_and_never_twice_in_a_batch():
    items = list(range(10))
    b = EpochBatches(items, 4, seed=0)
    seen = [b.next() for _ in range(5)]  # 20 items: two epochs exactly
    assert all(len(set(x)) == 4 for x in seen)
    flat = [i for x in seen for i in x]
    assert sorted(flat[:10]) == items and sorted(flat[10:]) == items and b.epoch == 1
