"""Trainer offload for colocated rollouts (megatron/offload.py) on the real Megatron buffers.

One subprocess (ensure_cpu_compat patches torch process-wide) runs workers/offload_roundtrip.py.
"""

from __future__ import annotations

import pytest

from tests.integration.megatron.result_lines import run_worker

WORKER = "tests.integration.megatron.workers.offload_roundtrip"

pytestmark = pytest.mark.slow  # one Megatron worker subprocess for all the tests


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(WORKER, str(tmp_path_factory.mktemp("offload")), done="OFFLOAD DONE")


@pytest.mark.parametrize("tag", ["fp32_actor", "bf16_actor", "frozen_critic"])
def test_round_trip_is_bit_exact_and_really_releases(results, tag):
    r = results[tag]
    assert all(r["resident"][p] > 0 for p in ("params", "grads", "optimizer")), r["resident"]
    assert r["released"] == {"params": 0, "grads": 0, "optimizer": 0}  # every storage resized to 0
    assert r["offloaded_bytes"] == r["onloaded_bytes"] == r["resident"]
    assert r["refused_while_offloaded"] and "onload" in r["refused_while_offloaded"]  # no segfault on a read
    assert r["differs_after_round_trip"] == []  # params, main params, Adam m/v/step: same bytes
    assert r["step_after_differs"] == [] and r["loss"][0] == r["loss"][1] and r["grad_norm"][0] == r["grad_norm"][1]


def test_bf16_moves_the_fp32_master_copy_with_the_optimizer(results):
    fp32, bf16 = results["fp32_actor"]["resident"], results["bf16_actor"]["resident"]
    # fp32: the distributed optimizer's main params are views into the param buffer (moved with params);
    # bf16: an fp32 master copy of its own, i.e. 2x the bf16 params on top of Adam's m and v.
    assert bf16["params"] * 2 == fp32["params"]
    assert bf16["optimizer"] > fp32["optimizer"]


def test_frozen_parameters_outside_ddp_buffers_are_moved_too(results):
    assert results["frozen_critic"]["frozen_params"] > 0


def test_partial_offload_keeps_params_usable_for_the_weight_export(results):
    r = results["partial"]
    assert r["device_bytes"]["grads"] == r["device_bytes"]["optimizer"] == 0 and r["device_bytes"]["params"] > 0
    assert r["logprobs_equal"]
    assert r["exported_every_rank"] == r["exported_root"] > 0  # world 1: the same tensors either way
