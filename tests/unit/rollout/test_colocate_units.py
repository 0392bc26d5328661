"""Colocated placement, the parts that need no engine: which ranks form which engine, how rank 0's
lockstep leader hands requests to the engines and reads their reports, the trainer's preflight.

The real vLLM shards in two torchrun ranks run in tests/e2e/test_colocated_e2e.py.
"""

from __future__ import annotations

import asyncio

import pytest

from megatron_sao.rollout.colocate.hub import LockstepEngine, RequestHub
from megatron_sao.rollout.colocate.layout import EngineLayout, layout_problems
from megatron_sao.rollout.colocate.lockstep import EngineDiverged, RoundLeader
from megatron_sao.rollout.engines.protocol import SamplingParams


@pytest.mark.parametrize("world, tp, engines, of_rank", [
    (2, 1, 2, [0, 1]),  # two data-parallel engines of one rank each
    (2, 2, 1, [0, 0]),  # one engine over both ranks
    (4, 2, 2, [0, 0, 1, 1]),  # consecutive blocks: {0,1}, {2,3}
])
def test_engines_are_consecutive_blocks_of_rollout_tp_ranks(world, tp, engines, of_rank):
    layouts = [EngineLayout(world, tp, r) for r in range(world)]
    assert {lay.engines for lay in layouts} == {engines}
    assert [lay.engine for lay in layouts] == of_rank
    assert [lay.engine_rank for lay in layouts] == [r % tp for r in range(world)]
    assert layouts[0].leaders() == list(range(0, world, tp))
    assert sorted(r for e in range(engines) for r in layouts[0].ranks_of(e)) == list(range(world))


def test_layouts_that_do_not_tile_the_world_name_the_key():
    assert "cluster.rollout_tp=4 must divide the trainer world (2 ranks)" in layout_problems(2, 4)[0]
    assert "cluster.gpus_per_node=6" in layout_problems(8, 4, gpus_per_node=6)[0]
    assert layout_problems(8, 4, gpus_per_node=8) == []
    with pytest.raises(ValueError, match="rollout_tp"):
        EngineLayout(3, 2, 0)


class _Loop:
    """An event loop on this thread for the hub's futures (the driver's loop in a run)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    def submit(self, engine: LockstepEngine, prompt, seed=None):
        async def go():
            return asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=seed)))
        return self.loop.run_until_complete(go())

    def settle(self):
        self.loop.run_until_complete(asyncio.sleep(0.01))


def _report(rank, engine, finished=(), unfinished=0, failed=()):
    return {"engine": engine, "rank": rank, "finished": list(finished), "failed": list(failed),
            "unfinished": unfinished, "error": None}


def test_leader_hands_each_engine_its_requests_and_resolves_them_with_the_version():
    hub, L = RequestHub(2, seed=0), _Loop()
    engines = [LockstepEngine(hub, e, f"e{e}") for e in range(2)]
    layout = EngineLayout(4, 2, 0)
    a = L.submit(engines[0], [1, 2, 3], seed=7)
    b = L.submit(engines[1], [4, 5])
    c = L.submit(engines[1], [6])
    L.settle()
    leader = RoundLeader(hub, layout, until=lambda: False, version=3, steps_per_round=8, heartbeat_s=60)
    cmd = leader.next_round()
    assert not cmd["end"] and cmd["steps"] == 8
    assert [w[1] for w in cmd["new"][0]] == [[1, 2, 3]] and [w[1] for w in cmd["new"][1]] == [[4, 5], [6]]
    (ra,) = cmd["new"][0]
    assert ra[3] == 7  # the agent loop's seed is kept; the others get one from rank 0, the same for every TP rank
    assert all(isinstance(w[3], int) for w in cmd["new"][1])
    fin_a = (ra[0], [9, 9], [-0.5, -0.25], "stop", None)  # (request, ids, log-probs, reason, routes)
    rb = cmd["new"][1][0][0]
    reports = [_report(0, 0, [fin_a]), _report(1, 0, [fin_a]),
               _report(2, 1, [(rb, [8], [-1.0], "length", None)], unfinished=1),
               _report(3, 1, [(rb, [8], [-1.0], "length", None)], unfinished=1)]
    leader.collect(reports)
    L.settle()
    assert a.result().token_ids == [9, 9] and a.result().versions == [3, 3]  # tokens carry the engine's version
    assert b.result().finish_reason == "length" and not c.done()
    assert leader.held == [0, 1]
    assert leader.stats.requests == {0: 1, 1: 1} and leader.stats.tokens == {0: 2, 1: 1}


def test_the_phase_ends_only_after_the_engines_drained():
    hub, L = RequestHub(1), _Loop()
    eng = LockstepEngine(hub, 0, "e0")
    stop = {"now": False}
    leader = RoundLeader(hub, EngineLayout(1, 1, 0), until=lambda: stop["now"], version=0, steps_per_round=4,
                         heartbeat_s=60)
    first = L.submit(eng, [1])
    L.settle()
    cmd = leader.next_round()
    rid = cmd["new"][0][0][0]
    leader.collect([_report(0, 0, unfinished=1)])
    stop["now"] = True
    later = L.submit(eng, [2])  # arrives after the end was decided: waits for the next phase
    L.settle()
    drain = leader.next_round()
    assert not drain["end"] and drain["new"] == {}  # no new request while draining; the held one finishes
    leader.collect([_report(0, 0, [(rid, [5], [-0.1], "stop", None)])])
    assert leader.next_round() == {"end": True, "error": None}
    L.settle()
    assert first.done() and not later.done() and hub.waiting() == 1


def test_diverged_tp_ranks_are_an_error_not_a_silent_sample():
    hub, L = RequestHub(1), _Loop()
    L.submit(LockstepEngine(hub, 0, "e0"), [1])
    L.settle()
    leader = RoundLeader(hub, EngineLayout(2, 2, 0), until=lambda: False, version=0, steps_per_round=4,
                         heartbeat_s=60)
    rid = leader.next_round()["new"][0][0][0]
    with pytest.raises(EngineDiverged, match="ranks 0 and 1 disagree"):
        leader.collect([_report(0, 0, [(rid, [5], [-0.1], "stop", None)]),
                        _report(1, 0, [(rid, [6], [-0.1], "stop", None)])])


def test_an_idle_leader_sends_heartbeat_rounds():
    leader = RoundLeader(RequestHub(1), EngineLayout(1, 1, 0), until=lambda: False, version=0, steps_per_round=4,
                         heartbeat_s=0.05, idle_wait_s=0.01)
    cmd = leader.next_round()  # nothing to do: an empty round once heartbeat_s passed
    assert cmd == {"end": False, "new": {}, "steps": 4}


def test_weights_never_go_through_the_lockstep_engine():
    eng = LockstepEngine(RequestHub(1), 0, "e0")
    with pytest.raises(RuntimeError, match="in-process on every rank"):
        asyncio.run(eng.begin_weight_update(1))


def test_preflight_names_every_key_that_rules_colocation_out():
    from megatron_sao.config import load_config
    from megatron_sao.trainer.colocated import colocated_problems

    base = ["cluster.placement=colocated", "rollout.colocate=true", "cluster.gpus_per_node=2"]
    ok = load_config(None, base + ["rollout.backend=vllm", "cluster.rollout_tp=2"])
    assert colocated_problems(ok, 2) == []  # vLLM here has the external launcher and layerwise reload
    bad = load_config(None, base + ["rollout.backend=hf", "parallel.pp=2", "rollout.weight_transport=nccl",
                                    "cluster.rollout_tp=4"])
    problems = " | ".join(colocated_problems(bad, 2, check_vllm=False))
    for key in ("rollout.backend", "parallel.pp", "rollout.weight_transport", "cluster.rollout_tp=4"):
        assert key in problems, key
