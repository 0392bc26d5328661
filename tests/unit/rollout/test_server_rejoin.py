"""A rollout server that died and answers again rejoins the run, but only through a whole weight update.

Scripted servers (the boundary: generate, health, the streamed-update surface and `score`); the
RolloutSide, its driver, server pool, weight sync, agent loop, environment and chat formatting are
real. What a 32-GPU job meets and the one-server demo never does: a `vllm serve` that is restarted
or comes back from an overload mid-run. Before this, such a server stayed out for the rest of the run.
"""

import asyncio
import time

import torch

from megatron_sao.envs.toy_tool import ToyToolTasks
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.rollout.prompts import PromptStream
from megatron_sao.rollout.rollout_side import RolloutSide, RolloutSideConfig
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer
from tests.engine_fixtures import answering
from tests.unit.rollout.test_episode_driver import ThreeTurns, wait_for

CHECK_TOKENS, CHECK_PROMPT_LEN = [5, 6, 7, 8, 9], 2
REFERENCE = [-1.0, -2.0, -3.0]  # what the trainer computed for CHECK_TOKENS[2:] under the new weights


def scripted_server(formatter, name: str, **kw):
    """One rollout server: answers `=0` (a one-turn toy answer) after 0.02 s, reports health, takes weight
    updates, scores the check tokens as the trainer did. `down` makes it fail generate and health (a
    crashed or overloaded server), `push_error` refuse the weight update, other `scores` disagree with
    the trainer's weight check."""
    return answering(formatter, name=name, delay=0.02, scores=REFERENCE, **kw)


def make_side(n=2, check=False, server_deadline_s=300.0, health_timeout_s=1.0, start_timeout_s=None,
              start_min_servers=1, rejoin_attempts=3):
    fmt = ChatFormatter(build_char_tokenizer())
    servers = [scripted_server(fmt, f"http://srv{i}") for i in range(n)]
    done = []
    cfg = RolloutSideConfig(batch_size=4, ahead=0, concurrency=4, sync_timeout_s=5.0, check_weights=check,
                            health_interval_s=0.05, health_timeout_s=health_timeout_s,
                            server_deadline_s=server_deadline_s, start_timeout_s=start_timeout_s,
                            start_min_servers=start_min_servers, rejoin_attempts=rejoin_attempts)
    side = RolloutSide(servers, lambda task: ThreeTurns(), PromptStream(ToyToolTasks(80, seed=0), seed=0), fmt,
                       AgentLoopConfig(max_turns=5, max_total_tokens=512, max_new_tokens_per_turn=32,
                                       sampling=SamplingParams(max_new_tokens=32)),
                       done.append, cfg, labels=[s.name for s in servers])
    return side, servers, done


def buckets():
    yield [("w", torch.zeros(4))]
    yield [("b", torch.zeros(2))]


def push(side, version, check):
    kw = (dict(check_tokens=CHECK_TOKENS, check_prompt_len=CHECK_PROMPT_LEN, reference_logprobs=REFERENCE)
          if check else {})
    return side.push_weights(buckets(), version, **kw)


def kill_and_recover(side, servers, done):
    """srv1 goes down mid-batch (its episodes move to srv0), then answers its health check again."""
    assert wait_for(lambda: servers[1].answered >= 1)
    servers[1].down = True
    assert wait_for(lambda: not side.pool.slots[1].alive)
    servers[1].down = False
    assert wait_for(lambda: side.pool.slots[1].healthy_again)
    assert not side.pool.slots[1].alive  # healthy is not enough: it still holds version 0
    assert wait_for(lambda: len(done) == 4, timeout=30)


def test_a_server_that_answers_again_rejoins_at_the_current_version():
    side, servers, done = make_side(check=True)
    side.start()
    try:
        kill_and_recover(side, servers, done)
        m = push(side, 1, check=True)
        assert not m.failed and set(m.logprob_diff) == {"http://srv0", "http://srv1"}
        side.step_finished()
        calls_before = servers[1].answered
        assert wait_for(lambda: len(done) == 8, timeout=30)
        metrics = side.metrics()
    finally:
        side.close()
    assert side.error is None
    assert servers[1].updates == [1] and servers[1].version == servers[0].version == 1
    assert servers[1].answered > calls_before  # it generates again
    late = [t for t in done[4:] if t.info["server"] == "http://srv1"]
    # Its episodes after the rejoin carry only new-version tokens.
    assert late and all(set(t.versions[t.action_mask].tolist()) == {1} for t in late)
    assert metrics["rollout/servers_alive"] == 2 and metrics["rollout/server_deaths"] == 1
    assert metrics["rollout/server_revivals"] == 1
    assert metrics["rollout/version_by_server"] == {"http://srv0": 1, "http://srv1": 1}


def test_with_no_server_in_service_a_restarted_one_gets_the_current_weights_at_once():
    """The only server dies (a `vllm serve` the node supervisor restarts): no episode starts and nothing
    is lost while it is down; once it answers, `needs_rejoin` asks the trainer for its current weights
    (no step has to end first), it takes the whole update, and the run goes on with every episode
    run once."""
    side, servers, done = make_side(n=1)
    side.start()
    try:
        assert wait_for(lambda: servers[0].answered >= 1)
        servers[0].down = True
        assert wait_for(lambda: not side.pool.slots[0].alive)
        assert side.error is None and not side.needs_rejoin  # waiting (rollout.server_deadline_s)
        servers[0].down = False
        assert wait_for(lambda: side.needs_rejoin)
        m = push(side, 0, check=False)  # the trainer's current version (what loop.py pushes)
        assert not m.failed and servers[0].version == 0
        assert side.pool.slots[0].alive and not side.needs_rejoin
        assert wait_for(lambda: len(done) == 4, timeout=30)
        side.step_finished()
        assert wait_for(lambda: len(done) == 8, timeout=30)
    finally:
        side.close()
    assert side.error is None and all(t.trainable for t in done)
    assert sorted(t.info["data_pos"] for t in done) == list(range(8))  # re-run, not lost
    assert side.metrics()["rollout/server_revivals"] == 1


def test_a_hung_server_does_not_delay_the_readmission_of_a_restarted_one():
    """srv0 hangs (a frozen `vllm serve`: its health call never answers), srv1 is restarted: srv1 is
    ready to rejoin as soon as it answers, not once srv0's check ran out its health_timeout_s."""
    side, servers, done = make_side(n=2, health_timeout_s=60.0)

    async def hang() -> bool:
        await asyncio.sleep(3600)
        return True
    side.start()
    try:
        assert wait_for(lambda: servers[1].answered >= 1)
        for s in servers:
            s.down = True
        assert wait_for(lambda: not side.pool.alive())
        servers[0].health = hang
        time.sleep(0.2)  # health rounds start on the hung server
        servers[1].down = False
        assert wait_for(lambda: side.needs_rejoin, timeout=10)  # not after 60 s
        assert [s.index for s in side.pool.rejoinable()] == [1]
    finally:
        side.close()


def test_a_rejoin_that_fails_is_tried_again_after_the_next_health_answer():
    """A restarted `vllm serve` can be slow on its first requests: one failed rejoin (here its transfer
    group broke) leaves it out and the run going, and it rejoins at a later update once it answers its
    health check again."""
    side, servers, done = make_side()
    side.start()
    try:
        kill_and_recover(side, servers, done)
        servers[1].push_error = OSError("http://srv1: transfer group gone (the server process restarted)")
        m = push(side, 1, check=False)
        assert "http://srv1" in m.failed and "transfer group gone" in m.failed["http://srv1"]
        slot = side.pool.slots[1]
        assert not slot.alive and slot.rejoin_failures == 1 and slot.rejoin_refused is None
        side.step_finished()
        assert wait_for(lambda: len(done) == 8, timeout=30)
        assert {t.info["server"] for t in done[4:]} == {"http://srv0"}  # out while it failed
        servers[1].push_error = None
        assert wait_for(lambda: slot.healthy_again)  # a candidate again after its next health answer
        m2 = push(side, 2, check=False)
        side.step_finished()
        assert wait_for(lambda: len(done) == 12, timeout=30)
        metrics = side.metrics()
    finally:
        side.close()
    assert side.error is None and not m2.failed and slot.alive
    assert servers[0].version == servers[1].version == 2
    assert metrics["rollout/server_revivals"] == 1


def test_a_server_that_fails_every_rejoin_is_left_out_for_good():
    """After `rejoin_attempts` failed rejoins a server stays out though it answers: a server that hangs
    in every update would otherwise cost a sync timeout every step."""
    side, servers, done = make_side(rejoin_attempts=2)
    side.start()
    try:
        kill_and_recover(side, servers, done)
        servers[1].push_error = OSError("http://srv1: transfer group gone (the server process restarted)")
        slot = side.pool.slots[1]
        for version in (1, 2):
            assert wait_for(lambda: slot.healthy_again)
            m = push(side, version, check=False)
            assert "http://srv1" in m.failed
        assert slot.rejoin_failures == 2 and "transfer group gone" in slot.rejoin_refused
        side.step_finished()
        assert wait_for(lambda: len(done) == 8, timeout=30)
        time.sleep(0.2)  # health rounds: a refused server is not checked, nor made a candidate again
        m3 = push(side, 3, check=False)  # a refused server is not tried again
    finally:
        side.close()
    assert side.error is None and not m3.failed
    assert servers[0].version == 3 and servers[1].version == 0 and not slot.alive
    assert not slot.healthy_again  # not a candidate any more, though it answers
    assert {t.info["server"] for t in done[4:]} == {"http://srv0"}
    assert side.metrics()["rollout/server_revivals"] == 0


def test_a_rejoining_server_with_wrong_weights_is_refused_not_the_run():
    side, servers, done = make_side(check=True, rejoin_attempts=1)
    side.start()
    try:
        kill_and_recover(side, servers, done)
        servers[1].scores = [x + 0.5 for x in REFERENCE]  # wrong weights
        m = push(side, 1, check=True)
    finally:
        side.close()
    assert side.error is None
    assert "weight check failed" in m.failed["http://srv1"] and "http://srv1" not in m.logprob_diff
    assert side.pool.slots[1].rejoin_refused and not side.pool.slots[1].alive
    assert m.logprob_diff == {"http://srv0": 0.0}


def test_an_evaluation_on_a_hung_server_times_out_and_frees_its_slots():
    fmt = ChatFormatter(build_char_tokenizer())
    side, _, _ = make_side()
    hung = answering(fmt, name="http://hung", delay=3600)  # alive (health passes) but never answers
    side.pool.slots[0].engine = side.pool.slots[1].engine = hung  # every server alive but stuck
    side.start()
    pinned = lambda: sum(s.episodes for s in side.pool.slots)  # noqa: E731
    try:
        assert wait_for(lambda: pinned() == 4)  # the training episodes (concurrency 4) hang too
        tasks = list(ToyToolTasks(6, seed=3))
        loop_cfg = AgentLoopConfig(max_turns=2, max_total_tokens=256, max_new_tokens_per_turn=16,
                                   sampling=SamplingParams(max_new_tokens=16), max_concurrency=4)
        try:
            side.evaluate(tasks, lambda task: ThreeTurns(), loop_cfg, timeout_s=0.5)
        except TimeoutError as e:
            msg = str(e)
        else:
            raise AssertionError("a hung evaluation returned")
        # Cancelled, not left running: the slots its episodes pinned are released.
        assert wait_for(lambda: pinned() == 4, timeout=5)
    finally:
        side.close()
    assert "evaluation of 6 tasks did not finish within 0.5s (run.eval_timeout_s)" in msg
    assert len(hung.calls) >= 8 and side.error is None  # 4 training + 4 evaluation requests were sent


def test_the_servers_open_the_update_while_the_first_bucket_is_produced():
    """push_weights asks every server to pause and open the update, then produces the first bucket (the
    export's gathers) while they do, instead of one after the other: a server's begin here waits for
    the first bucket's production to start, which it never sees when the two run in turn."""
    import threading

    side, servers, done = make_side()
    producing, seen = threading.Event(), []
    for s in servers:
        plain = s.begin_weight_update

        async def begin(version, plain=plain):
            import asyncio

            seen.append(await asyncio.to_thread(producing.wait, 3.0))
            await plain(version)
        s.begin_weight_update = begin

    def slow_export():
        producing.set()
        yield from buckets()
    side.start()
    try:
        assert wait_for(lambda: len(done) >= 1)
        m = side.push_weights(slow_export(), 1)
    finally:
        side.close()
    assert seen == [True, True] and not m.failed and [s.version for s in servers] == [1, 1]


def starting_side(n=2, start_timeout_s=60.0, start_min_servers=1):
    """Servers still loading when the trainer starts: down (no /health answer) until a test brings them up."""
    side, servers, done = make_side(n=n, start_timeout_s=start_timeout_s, start_min_servers=start_min_servers)
    for s in servers:
        s.down = True
    side.driver.START_POLL_S = 0.05
    return side, servers, done


def test_the_trainer_starts_before_its_servers_and_each_serves_once_it_answers():
    """No server answers at the start: nothing runs, the batch wait is told to wait (awaiting_server),
    and each server enters service as it answers /health, at the version it loaded (no weight update
    has begun: it holds the trainer's starting weights)."""
    side, servers, done = starting_side()
    side.start()
    try:
        time.sleep(0.3)
        assert not side.pool.alive() and side.awaiting_server and not side.needs_rejoin
        assert not done and not servers[0].calls and side.error is None
        servers[0].down = False
        assert wait_for(lambda: side.pool.slots[0].alive) and not side.pool.slots[1].alive
        assert wait_for(lambda: len(done) == 4, timeout=30)  # served by the one that is up
        assert not side.awaiting_server and not servers[1].calls
        servers[1].down = False
        assert wait_for(lambda: side.pool.slots[1].alive)
        side.step_finished()
        assert wait_for(lambda: len(done) == 8, timeout=30)
    finally:
        side.close()
    assert side.error is None and all(t.trainable for t in done)
    assert servers[0].updates == servers[1].updates == []  # in service without a weight update
    assert {t.info["server"] for t in done[4:]} == {"http://srv0", "http://srv1"}
    m = side.metrics()
    assert m["rollout/servers_alive"] == 2 and m["rollout/server_deaths"] == 0 and m["rollout/server_revivals"] == 0


def test_start_min_servers_holds_the_first_episodes_until_that_many_serve():
    """rollout.start_min_servers=0 (every server): with srv0 up and srv1 still loading nothing starts
    and the batch wait is told to wait (the liveness timeout must not run out meanwhile); once srv1 is
    up both get the first batch's episodes. A server that dies later does not hold the run again."""
    side, servers, done = starting_side(start_min_servers=0)
    side.start()
    try:
        servers[0].down = False
        assert wait_for(lambda: side.pool.slots[0].alive)
        time.sleep(0.3)
        assert not done and not servers[0].calls and side.awaiting_server and side.error is None
        servers[1].down = False
        assert wait_for(lambda: len(done) == 4, timeout=30)
        assert not side.awaiting_server
        servers[1].down = True
        assert wait_for(lambda: not side.pool.slots[1].alive)
        side.step_finished()
        assert wait_for(lambda: len(done) == 8, timeout=30)  # on srv0 alone
    finally:
        side.close()
    assert side.error is None
    assert {t.info["server"] for t in done[:4]} == {"http://srv0", "http://srv1"}


def test_start_min_servers_waits_no_longer_than_the_start_timeout():
    """Asked for both, but srv1 never comes up: the hold does not outlast rollout.server_start_timeout_s,
    whose error names srv1, and nothing ran on srv0 meanwhile."""
    side, servers, done = starting_side(start_timeout_s=1.0, start_min_servers=2)
    side.start()
    try:
        servers[0].down = False
        # generous: the start timeout's bound is what the error says, not how long this waits (load 26: 10 s ran out)
        assert wait_for(lambda: side.error is not None, timeout=60)
        assert not done and not side.awaiting_server
    finally:
        side.close()
    assert "http://srv1" in str(side.error) and "rollout.server_start_timeout_s" in str(side.error)


def test_after_a_resumed_push_a_server_that_comes_up_gets_the_weights_before_it_serves():
    """A resume pushes the resumed weights before any server is up: nothing to send yet (the trainer's
    export is still drained); the server that comes up then rejoins with the current weights
    (needs_rejoin: the trainer pushes them) and only then serves, never at its base version."""
    side, servers, done = starting_side(n=1)
    side.start()
    try:
        drained = []
        m = side.push_weights((drained.append(b) or b for b in buckets()), 3)
        assert len(drained) == 2 and not m.failed and not m.per_engine_seconds and servers[0].updates == []
        servers[0].down = False
        assert wait_for(lambda: side.needs_rejoin)
        assert not side.pool.slots[0].alive and not servers[0].calls
        assert not push(side, 3, check=False).failed
        assert side.pool.slots[0].alive and servers[0].updates == [3]
        assert wait_for(lambda: len(done) == 4, timeout=30)
    finally:
        side.close()
    assert side.error is None
    assert all(set(t.versions[t.action_mask].tolist()) == {3} for t in done)
    assert side.metrics()["rollout/server_revivals"] == 0  # its first entry, not a comeback


def test_on_a_resume_the_start_holds_for_a_server_that_comes_up_after_the_others_took_the_weights():
    """rollout.start_min_servers=0 on a resume: srv0 comes up and takes the resumed weights; srv1 comes up
    only then (it holds the base model). The hold goes on and asks for its rejoin at once, so both serve
    the first batch at the resumed version (before, the hold ended with srv1 up but rejoining, and srv1
    waited for the first step's update: a short resumed attempt could end without it serving)."""
    side, servers, done = starting_side(start_min_servers=0)
    side.start()
    try:
        side.push_weights(iter(buckets()), 3)  # the resumed push: no server is up yet
        servers[0].down = False
        assert wait_for(lambda: side.needs_rejoin)
        assert not push(side, 3, check=False).failed and side.pool.slots[0].alive
        time.sleep(0.3)
        assert not side.needs_rejoin and not done and side.awaiting_server  # held for srv1, still starting
        servers[1].down = False
        assert wait_for(lambda: side.needs_rejoin)
        assert not servers[0].calls and not servers[1].calls  # no episode before srv1 has the weights
        assert not push(side, 3, check=False).failed and side.pool.slots[1].alive
        assert wait_for(lambda: len(done) == 4, timeout=30)
    finally:
        side.close()
    assert side.error is None and servers[1].updates == [3]
    assert {t.info["server"] for t in done} == {"http://srv0", "http://srv1"}
    assert all(set(t.versions[t.action_mask].tolist()) == {3} for t in done)


def test_a_server_that_never_answers_stops_the_run_naming_it():
    """srv0 comes up and serves; srv1 never answers /health: past rollout.server_start_timeout_s the
    run stops with an error naming srv1's URL (and not srv0's), even though the other one serves."""
    side, servers, done = starting_side(start_timeout_s=1.5)
    side.start()
    try:
        servers[0].down = False
        assert wait_for(lambda: len(done) >= 1)
        assert side.error is None
        assert wait_for(lambda: side.error is not None, timeout=10)
    finally:
        side.close()
    msg = str(side.error)
    assert "never answered /health within 1.5s of the start (rollout.server_start_timeout_s)" in msg
    assert "http://srv1" in msg and "http://srv0" not in msg
