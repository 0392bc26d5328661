"""The process-group timeout comes from the config: it holds one weight-bucket push of rank 0."""

from __future__ import annotations

import pytest

from megatron_sao.config import load_config
from megatron_sao.megatron.parallel import DEFAULT_TIMEOUT_S, PG_TIMEOUT_MARGIN_S, process_group_timeout_s

RECIPE = "examples/qwen3_30b_a3b/aime_disaggregated.yaml"


def test_short_rollout_timeouts_keep_the_default():
    assert process_group_timeout_s(120.0, environ={}) == DEFAULT_TIMEOUT_S


def test_a_recipe_rollout_timeout_raises_the_collective_timeout_above_it():
    cfg = load_config(RECIPE, [])
    assert cfg.rollout.timeout_s == 1800  # the recipes' value this guards against
    assert process_group_timeout_s(cfg.rollout.timeout_s, environ={}) == 1800 + PG_TIMEOUT_MARGIN_S


def test_an_override_is_taken_when_it_holds():
    assert process_group_timeout_s(600.0, environ={"SAO_PG_TIMEOUT_S": "3600"}) == 3600.0


@pytest.mark.parametrize("raw, msg", [("300", r"SAO_PG_TIMEOUT_S=300 must exceed rollout.timeout_s=1800"),
                                      ("ten", r"SAO_PG_TIMEOUT_S='ten' is not a number")])
def test_an_override_that_cannot_hold_is_refused(raw, msg):
    with pytest.raises(ValueError, match=msg):
        process_group_timeout_s(1800.0, environ={"SAO_PG_TIMEOUT_S": raw})
