"""EpisodeDriver: admission control (sync = one batch per step), requeue to the front, the circuit
breaker that stops a run whose rollout engine died, the trainer step reaching the environment
(`policy_step`), and several servers: least-loaded placement, an episode keeping its server for all
its turns, the per-server request cap, a dead server's episodes re-run elsewhere, every server dead.
The engines are scripted fakes (the boundary); the environment, tokenizer, chat formatting, agent
loop and server pool are real."""

import asyncio
import time

from megatron_sao.envs import make_env
from megatron_sao.envs.base import StepResult
from megatron_sao.envs.style_shift import load_style_tasks
from megatron_sao.envs.toy_tool import ToyToolTasks
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.rollout.episode_driver import EpisodeDriver
from megatron_sao.rollout.prompts import PromptStream
from megatron_sao.rollout.server_pool import ServerPool
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer
from tests.engine_fixtures import answering


class ThreeTurns:
    """An environment that asks twice before it is done (the boundary): three turns per episode."""

    def __init__(self):
        self.turns = 0

    async def reset(self, task):
        self.turns = 0

    async def step(self, action_text):
        self.turns += 1
        return StepResult("again" if self.turns < 3 else None, self.turns >= 3, reward=1.0)

    async def close(self):
        pass


def make_pool_driver(n_servers=3, concurrency=6, batch_size=6, max_num_seqs=None, delay=0.02, **driver_kw):
    fmt = ChatFormatter(build_char_tokenizer())
    engines = [answering(fmt, name=f"http://srv{i}", delay=delay) for i in range(n_servers)]
    pool = ServerPool(engines, [e.name for e in engines], max_num_seqs=max_num_seqs)
    done = []
    drv = EpisodeDriver(pool, lambda task: ThreeTurns(), PromptStream(ToyToolTasks(50, seed=0), seed=0), fmt,
                        AgentLoopConfig(max_turns=5, max_total_tokens=512, max_new_tokens_per_turn=32,
                                        sampling=SamplingParams(max_new_tokens=32)),
                        done.append, batch_size=batch_size, ahead=0, concurrency=concurrency, **driver_kw)
    return drv, done, engines, pool


def make_driver(batch_size=4, ahead=0, broken=False, concurrency=8, env="toy_tool", answer="=0", **driver_kw):
    fmt = ChatFormatter(build_char_tokenizer())
    done = []
    engine = answering(fmt, answer, name="fake", down=broken)
    if env == "toy_tool":
        tasks, factory = ToyToolTasks(50, seed=0), (lambda task: make_env("toy_tool"))
    else:  # style_shift, its style switching every trainer step: cute, classical, cute, ...
        tasks, factory = load_style_tasks(50, seed=0), (
            lambda task: make_env("style_shift", switch_every=1, styles=["cute", "classical"]))
    drv = EpisodeDriver(engine, factory, PromptStream(tasks, seed=0), fmt,
                        AgentLoopConfig(max_turns=2, max_total_tokens=256, max_new_tokens_per_turn=64,
                                        sampling=SamplingParams(max_new_tokens=64)),
                        done.append, batch_size=batch_size, ahead=ahead, concurrency=concurrency, **driver_kw)
    return drv, done, engine


def wait_for(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    return cond()


def test_sync_admission_runs_exactly_one_batch_per_step():
    drv, done, _ = make_driver(batch_size=4, ahead=0)
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 4)
        time.sleep(0.3)
        assert len(done) == 4  # the barrier: nothing more until the trainer finishes its step
        drv.step_finished()
        assert wait_for(lambda: len(done) == 8)
        assert sorted(t.info["data_pos"] for t in done) == list(range(8))  # the prompt stream, in order
        assert drv.state()["next_pos"] == 8 and drv.state()["in_flight"] == []
    finally:
        drv.stop()


def test_async_admission_runs_ahead_by_the_staleness_bound():
    drv, done, _ = make_driver(batch_size=4, ahead=2)
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 12)
        time.sleep(0.3)
        assert len(done) == 12  # (steps_done + ahead + 1) * batch_size
    finally:
        drv.stop()


def test_a_resumed_driver_counts_the_restored_trajectories_against_the_window():
    # The buffer restored the trajectories of positions 0-2 (a resume): they wait for the next steps and
    # fill 3 of the window's (ahead + 1) * batch_size = 8 places, so only 5 episodes start.
    drv, done, _ = make_driver(batch_size=4, ahead=1, skip={(0, 0), (1, 0), (2, 0)})
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 5)
        time.sleep(0.3)
        assert sorted(t.info["data_pos"] for t in done) == [3, 4, 5, 6, 7]
        drv.step_finished()
        assert wait_for(lambda: len(done) == 9)
    finally:
        drv.stop()


def test_requeued_prompt_runs_first():
    drv, done, _ = make_driver(batch_size=2, ahead=0)
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 2)
        stale = done[0]
        drv.requeue(stale)  # as the buffer does when it drops a stale trajectory
        assert wait_for(lambda: len(done) == 3)
        assert done[2].info["data_pos"] == stale.info["data_pos"]
    finally:
        drv.stop()


def test_episodes_failing_on_a_healthy_engine_trip_the_circuit_breaker():
    drv, done, engine = make_driver(batch_size=4, ahead=0, concurrency=8)

    def no_env(task):
        raise ValueError("no such environment")
    drv.env_factory = no_env  # every episode fails, yet the engine answers /health
    drv.start()
    try:
        assert wait_for(lambda: drv.error is not None, timeout=60)
    finally:
        drv.stop()
    assert "episodes in a row failed with a healthy engine" in str(drv.error)
    assert len(done) >= 4 * drv.failure_threshold and not any(t.trainable for t in done)


def test_dead_engine_stops_the_driver_with_a_clear_error():
    drv, done, engine = make_driver(batch_size=4, ahead=0, broken=True, concurrency=8, server_deadline_s=0)
    drv.start()
    try:
        assert wait_for(lambda: drv.error is not None)
        assert "unhealthy" in str(drv.error) and "refused the connection" in str(drv.error)
        # deadline 0: the run stops when the last server dies; its episodes stay queued for a resume
        assert not done and len(drv.state()["queued"]) >= 1
        calls = len(engine.calls)
        time.sleep(0.3)
        assert len(engine.calls) == calls  # stopped, not spinning through the prompt stream
    finally:
        drv.stop()


def test_policy_step_reaches_the_environment():
    """Each episode's task carries the trainer steps finished when it started; the style-shift env
    judges with that step's style and reports it in the trajectory's info."""
    drv, done, _ = make_driver(batch_size=2, ahead=0, env="style_shift", answer="Hehe~ a fluffy bunny, yay! <3")
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 2)
        drv.step_finished()
        assert wait_for(lambda: len(done) == 4)
        drv.step_finished()
        assert wait_for(lambda: len(done) == 6)
    finally:
        drv.stop()
    assert all(t.trainable for t in done)
    by_pos = sorted(done, key=lambda t: t.info["data_pos"])
    assert [t.info["policy_step"] for t in by_pos] == [0, 0, 1, 1, 2, 2]
    assert [t.info["env_info"]["step"] for t in by_pos] == [0, 0, 1, 1, 2, 2]
    assert [t.info["env_info"]["style"] for t in by_pos] == ["cute", "cute", "classical", "classical", "cute", "cute"]
    assert [t.reward for t in by_pos] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # the cute answer, judged per step


def test_policy_step_counts_from_the_resumed_step():
    drv, done, _ = make_driver(batch_size=2, ahead=0, env="style_shift", answer="Alas, thou art here.",
                               step_offset=5)
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 2)
    finally:
        drv.stop()
    assert {t.info["policy_step"] for t in done} == {5}
    assert {t.info["env_info"]["style"] for t in done} == {"classical"} and {t.reward for t in done} == {1.0}


def test_episodes_spread_over_every_server_and_keep_theirs_for_all_turns():
    drv, done, engines, pool = make_pool_driver(n_servers=3, concurrency=6, batch_size=6)
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 6)
    finally:
        drv.stop()
    assert all(t.trainable and t.num_turns == 3 for t in done)
    by_server = {e.name: sum(t.info["server"] == e.name for t in done) for e in engines}
    assert by_server == {"http://srv0": 2, "http://srv1": 2, "http://srv2": 2}  # least loaded first
    for t in done:  # every turn of an episode went to its server: only it saw the episode's prefixes
        mask = t.action_mask.tolist()
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        prefixes = [t.tokens[:i].tolist() for i in starts]
        assert len(prefixes) == 3
        for e in engines:
            seen = sum(p in e.prompts for p in prefixes)
            assert seen == (3 if e.name == t.info["server"] else 0), (e.name, t.info["server"], seen)
    assert pool.metrics()["rollout/episodes_by_server"] == by_server


def test_per_server_cap_holds_requests_back():
    drv, done, engines, pool = make_pool_driver(n_servers=2, concurrency=8, batch_size=8, max_num_seqs=2, delay=0.05)
    drv.start()
    try:
        assert wait_for(lambda: len(done) == 8)
    finally:
        drv.stop()
    assert [e.max_active for e in engines] == [2, 2]  # 4 episodes per server, at most 2 requests in flight
    assert all(s.max_in_flight == 2 for s in pool.slots)


def test_a_dead_server_gets_no_episodes_and_its_episodes_rerun_elsewhere():
    drv, done, engines, pool = make_pool_driver(n_servers=2, concurrency=4, batch_size=4, delay=0.3,
                                                health_interval_s=0.1, health_timeout_s=1.0)
    drv.start()
    try:
        assert wait_for(lambda: len(engines[1].calls) >= 1)
        engines[1].down = True  # its health check fails now; its in-flight episodes must move
        assert wait_for(lambda: len(done) == 4, timeout=30)
        drv.step_finished()
        assert wait_for(lambda: len(done) == 8, timeout=30)
    finally:
        drv.stop()
    assert drv.error is None and all(t.trainable for t in done)
    assert {t.info["server"] for t in done} == {"http://srv0"}  # nothing half-done from the dead one
    assert sorted(t.info["data_pos"] for t in done) == list(range(8))  # every unit once: re-run, not lost
    m = pool.metrics()
    assert m["rollout/servers_alive"] == 1 and m["rollout/server_deaths"] == 1 and m["rollout/episodes_rerun"] >= 1
    assert not pool.slots[1].alive and "health check failed" in pool.slots[1].dead_reason


def test_a_hung_server_does_not_delay_the_health_checks_of_the_others():
    """srv0 hangs (a frozen `vllm serve`: its health call never answers in health_timeout_s = 60 s), then
    srv1 fails its health check while its generates still answer (only the health monitor can see it):
    srv1 is out of service within a few intervals, not once srv0's check ran out its 60 s."""
    drv, done, engines, pool = make_pool_driver(n_servers=2, concurrency=4, batch_size=4, delay=0.05,
                                                health_interval_s=0.05, health_timeout_s=60.0)

    async def hang() -> bool:
        await asyncio.sleep(3600)
        return True

    async def unhealthy() -> bool:
        return False
    engines[0].health = hang
    drv.start()
    try:
        time.sleep(0.3)  # health checks start on the hung server
        assert pool.slots[1].alive
        engines[1].health = unhealthy
        t0 = time.monotonic()
        assert wait_for(lambda: not pool.slots[1].alive, timeout=10)
        noticed = time.monotonic() - t0
    finally:
        drv.stop()
    assert noticed < 5 and "health check failed" in pool.slots[1].dead_reason
    assert pool.slots[0].alive  # its check is still pending: not yet failed
    assert drv.error is None


def test_every_server_dead_past_the_deadline_stops_the_driver_naming_each():
    drv, done, engines, pool = make_pool_driver(n_servers=2, concurrency=4, batch_size=4, delay=0.05,
                                                health_interval_s=0.05, health_timeout_s=1.0, server_deadline_s=0.5)
    for e in engines:
        e.down = True
    t0 = time.monotonic()
    drv.start()
    try:
        assert wait_for(lambda: not pool.alive())
        assert wait_for(lambda: drv.error is not None)
        waited = time.monotonic() - t0
    finally:
        drv.stop()
    msg = str(drv.error)
    assert "every rollout server is out of service (for 0.5s" in msg and "http://srv0" in msg and "http://srv1" in msg
    # It waited the deadline for a server to come back: the deadline starts after the last death, which
    # is after the start (timed from the start, as a poll of pool.alive() may return late on a busy machine).
    assert waited >= 0.5
    # Nothing is recorded as failed while no server can run it: every started unit is queued for a resume.
    assert not done and len(drv.state()["queued"]) >= 1
    assert pool.metrics()["rollout/episodes_rerun"] >= 1 and pool.metrics()["rollout/servers_alive"] == 0


def test_the_driver_awaits_a_server_until_the_deadline_then_stops():
    """`awaiting_server` is what keeps the trainer's batch wait going past rollout.timeout_s: true only
    while no server is in service and the deadline is pending."""
    drv, done, engines, pool = make_pool_driver(n_servers=2, concurrency=4, batch_size=4, delay=0.05,
                                                health_interval_s=0.05, health_timeout_s=1.0, server_deadline_s=3.0)
    drv.start()
    try:
        assert wait_for(lambda: len(done) >= 1) and not drv.awaiting_server  # serving
        for e in engines:
            e.down = True
        assert wait_for(lambda: not pool.alive())
        assert drv.awaiting_server and drv.error is None
        assert wait_for(lambda: drv.error is not None)
        assert not drv.awaiting_server  # past the deadline the error stops the wait instead
    finally:
        drv.stop()


def test_engines_closed_at_the_end_of_a_run_are_not_reported_as_failed_servers(caplog):
    """At shutdown the episodes are cancelled and then the engines closed; a health check that lands
    after that must not take the server out of service and log "no rollout server in service"."""
    drv, done, engines, pool = make_pool_driver(n_servers=1, concurrency=2, batch_size=2, delay=0.02,
                                                health_interval_s=0.05, health_timeout_s=1.0)

    async def closed() -> bool:
        return False
    drv.start()
    try:
        assert wait_for(lambda: len(done) >= 2)
        drv.call(drv.cancel_episodes(), timeout=10)
        engines[0].health = closed  # what a closed vLLM engine answers
        time.sleep(0.3)  # several health intervals
    finally:
        drv.stop()
    assert pool.slots[0].alive and drv.error is None
    assert "out of service" not in caplog.text and "no rollout server" not in caplog.text
