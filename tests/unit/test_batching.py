"""The batch plan (megatron/batching.py): rows over DP ranks by compute cost, token-budget micro-batches,
the shape rules of the layouts, and the tensors cut from a plan."""

import random

import pytest
import torch

from megatron_sao.config import ConfigError, config_from_dict
from megatron_sao.megatron.batching import (
    BUDGET_KEY,
    ShapeRule,
    micro_batches,
    plan_balanced,
    plan_contiguous,
    plan_stats,
    round_up,
    validate_batch,
)
from megatron_sao.megatron.compute_cost import CostModel
from megatron_sao.megatron.partition import karmarkar_karp
from megatron_sao.models.hf_config import model_spec_from_hf
from megatron_sao.models.presets import qwen3_30b_a3b_config

COST = CostModel(6.5e-5)


def long_tailed(n=128, seed=0):
    rng = random.Random(seed)
    return [min(max(int(rng.lognormvariate(9.65, 0.95)), 2048), 131072) for _ in range(n)]


def all_rows(plan):
    return sorted(r for slots in plan.per_rank for s in slots for r in s.rows)


def test_karmarkar_karp_places_every_item_once_and_balances_a_long_tail():
    weights = [COST.row(n) for n in long_tailed()]
    parts = karmarkar_karp(weights, 8)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    sums = [sum(weights[i] for i in p) for p in parts]
    bound = max(sum(weights) / 8, max(weights))  # no partition can beat this
    assert max(sums) <= 1.02 * bound
    assert karmarkar_karp([3, 3, 2, 2, 2], 2) in ([[0, 2], [1, 3, 4]], [[1, 3, 4], [0, 2]], [[0, 3], [1, 2, 4]],
                                                  [[1, 2, 4], [0, 3]], [[2, 3, 4], [0, 1]], [[0, 1], [2, 3, 4]])
    assert karmarkar_karp([5.0], 3) == [[0], [], []] or sorted(map(len, karmarkar_karp([5.0], 3))) == [0, 0, 1]


def test_the_cost_model_of_qwen3_30b_a3b_puts_attention_even_with_the_rest_near_15k_tokens():
    cost = CostModel.for_model(model_spec_from_hf(qwen3_30b_a3b_config()))
    assert 14_000 < 1 / cost.attention_coeff < 17_000


def test_budgeted_plan_covers_every_row_once_within_the_budget_and_pads_only_to_its_own_rows():
    lengths = long_tailed(seed=1) + [100, 120, 130, 2048, 2050]
    plan = plan_balanced(lengths, dp=8, micro_batch_size=64, max_tokens=131072, seq_multiple=4, cost=COST)
    assert all_rows(plan) == list(range(len(lengths)))
    for slots in plan.per_rank:
        for s in slots:
            assert s.tokens <= 131072 and s.height == len(s.rows)
            assert s.width == round_up(max(lengths[r] for r in s.rows), 4)  # its own longest row
    # one rank: rows of about one length share a micro-batch, a short row does not ride with a long one
    one = plan_balanced([100, 4000, 120, 130, 3990, 3000], dp=1, micro_batch_size=64, max_tokens=16384,
                        seq_multiple=1, cost=COST)
    assert [s.rows for s in one.per_rank[0]] == [(1, 4), (5,), (3, 2), (0,)]
    capped = plan_balanced([100] * 5, dp=1, micro_batch_size=2, max_tokens=16384, seq_multiple=1, cost=COST)
    assert [s.height for s in capped.per_rank[0]] == [2, 2, 1]  # micro_batch_size caps the rows


def test_a_row_longer_than_the_budget_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=BUDGET_KEY.replace(".", r"\.")):
        plan_balanced([100, 5000], dp=2, micro_batch_size=8, max_tokens=4096, seq_multiple=1, cost=COST)
    with pytest.raises(ConfigError, match="parallel.max_tokens_per_micro_batch"):
        config_from_dict({}, ["model.max_seq_len=8192", "parallel.max_tokens_per_micro_batch=4096"])
    with pytest.raises(ConfigError, match="parallel.cp: context parallelism is not supported"):
        config_from_dict({"parallel": {"cp": 2}})


def test_equal_count_splits_before_it_adds_dummies():
    for seed in range(20):
        lengths = long_tailed(n=24, seed=seed) + [100] * (seed % 7)
        plan = plan_balanced(lengths, dp=4, micro_batch_size=8, max_tokens=131072, seq_multiple=2, cost=COST,
                             rule=ShapeRule(equal_count=True))
        assert len({len(s) for s in plan.per_rank}) == 1 and all_rows(plan) == list(range(len(lengths)))
        for slots in plan.per_rank:
            if any(not s.rows for s in slots):  # a dummy only where nothing could be split further
                assert all(len(s.rows) <= 1 for s in slots)
    one = plan_balanced([4000, 3000, 100], dp=2, micro_batch_size=8, max_tokens=4096, seq_multiple=1, cost=COST,
                        rule=ShapeRule(equal_count=True))
    assert [len(s) for s in one.per_rank] == [2, 2]
    dummies = [s for slots in one.per_rank for s in slots if not s.rows]
    assert len(dummies) == 1 and dummies[0].tokens == 2  # a [1, 2] forward, zero everywhere
    free = plan_balanced([4000, 3000, 100], dp=2, micro_batch_size=8, max_tokens=4096, seq_multiple=1, cost=COST)
    assert sorted(len(s) for s in free.per_rank) == [1, 2]  # dense layouts: no dummy


def test_equal_shapes_give_micro_batch_i_one_shape_on_every_rank_within_the_budget():
    lengths = long_tailed(seed=2, n=40)
    plan = plan_balanced(lengths, dp=4, micro_batch_size=16, max_tokens=131072, seq_multiple=2, cost=COST,
                         rule=ShapeRule(equal_count=True, equal_shapes=True))
    assert all_rows(plan) == list(range(len(lengths)))
    n = {len(s) for s in plan.per_rank}
    assert len(n) == 1
    for i in range(n.pop()):
        shapes = {(slots[i].height, slots[i].width) for slots in plan.per_rank}
        assert len(shapes) == 1 and shapes.pop()[0] * plan.per_rank[0][i].width <= 131072


def test_fixed_shape_for_pipeline_parallel():
    plan = plan_balanced([5, 9, 3, 7, 2], dp=2, micro_batch_size=2, max_tokens=None, seq_multiple=1, cost=COST,
                         rule=ShapeRule(fixed_shape=True))
    assert {(s.height, s.width) for slots in plan.per_rank for s in slots} == {(2, 9)}
    assert all_rows(plan) == [0, 1, 2, 3, 4]


def test_the_contiguous_rule_is_the_one_it_replaced():
    # sorted shortest first: rank 0 rows 3,6,0,7 (2,2,3,3), rank 1 rows 1,4,5,2 (4,5,6,9)
    plan = plan_contiguous([3, 4, 9, 2, 5, 6, 2, 3], dp=2, micro_batch_size=2, seq_multiple=1)
    assert [s.rows for s in plan.per_rank[0]] == [(3, 6), (0, 7)]
    assert [s.rows for s in plan.per_rank[1]] == [(1, 4), (5, 2)]
    assert [s.width for s in plan.per_rank[0]] == [5, 9] == [s.width for s in plan.per_rank[1]]


def test_balanced_beats_contiguous_on_a_long_tail_at_dp8():
    lengths = long_tailed(seed=3)
    new = plan_stats(plan_balanced(lengths, dp=8, micro_batch_size=64, max_tokens=131072, seq_multiple=4,
                                   cost=COST, rule=ShapeRule(equal_count=True)), lengths, COST)
    old = plan_stats(plan_contiguous(lengths, dp=8, micro_batch_size=1, seq_multiple=4), lengths, COST)
    assert old.compute_ratio > 2.0 and old.padding_fraction > 0.3
    assert new.compute_ratio < 1.15 and new.padding_fraction < 0.05
    assert len(set(new.forward_calls)) == 1


def test_micro_batch_tensors_follow_the_plan_for_every_field():
    b, t = 5, 8
    lengths = [8, 3, 6, 2, 5]
    mask = torch.tensor([[1] * n + [0] * (t - n) for n in lengths], dtype=torch.bool)
    batch = {"tokens": torch.arange(b * t).reshape(b, t) * mask, "attention_mask": mask,
             "routed": torch.randn(b, t, 3, 2) * mask[..., None, None], "row_id": torch.arange(b) + 100}
    assert validate_batch(batch) == (b, t)
    plan = plan_balanced(lengths, dp=2, micro_batch_size=2, max_tokens=None, seq_multiple=1, cost=COST,
                         rule=ShapeRule(equal_count=True))
    seen = []
    for rank in range(2):
        for slot, mb in zip(plan.per_rank[rank], micro_batches(batch, plan, rank)):
            assert mb["tokens"].shape == (slot.height, slot.width)
            assert mb["routed"].shape == (slot.height, slot.width, 3, 2)
            for j, r in enumerate(slot.rows):
                w = slot.width
                assert torch.equal(mb["tokens"][j], batch["tokens"][r, :w]) and int(mb["row_id"][j]) == 100 + r
                assert torch.equal(mb["routed"][j], batch["routed"][r, :w])
                assert not batch["attention_mask"][r, w:].any()  # nothing real was cut
            assert not mb["attention_mask"][len(slot.rows):].any()
            seen += slot.rows
    assert sorted(seen) == list(range(b))
    with pytest.raises(ValueError, match="routed"):
        validate_batch({**batch, "routed": torch.zeros(b, t + 1, 3)})
