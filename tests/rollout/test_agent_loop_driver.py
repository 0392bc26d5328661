"""RolloutDriver: a background-thread producer with start/stop, counters and error surfacing."""

from __future__ import annotations

import itertools
import threading

import pytest
from test_agent_loop_fakes import CountingEnv, ScriptedEngine, task

from megatron_sao.rollout.agent_loop import AgentLoopConfig, RolloutDriver
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engine import SamplingParams
from megatron_sao.tokenizers import build_char_tokenizer, char_token_id

TOK = build_char_tokenizer()
F = ChatFormatter(TOK)
END = char_token_id(TOK, "<|end|>")
CFG = AgentLoopConfig(max_turns=4, max_total_tokens=128, max_new_tokens_per_turn=16,
                      sampling=SamplingParams(max_new_tokens=16), max_concurrency=3)
WAIT = 60.0  # generous upper bound for a loaded CI machine; never a timing assertion


def action(n, prefix):
    return TOK.encode("CALL 1", add_special_tokens=False) + [END]


class Collector:
    """on_done target: records trajectories, signals once ``n`` arrived, counts concurrent callers."""

    def __init__(self, n: int) -> None:
        self.n, self.trajs, self.event, self.lock = n, [], threading.Event(), threading.Lock()
        self.threads: set[str] = set()

    def __call__(self, traj) -> None:
        with self.lock:
            self.trajs.append(traj)
            self.threads.add(threading.current_thread().name)
            if len(self.trajs) >= self.n:
                self.event.set()


def endless_tasks():
    return (task(i) for i in itertools.count())


def test_driver_keeps_episodes_in_flight_until_stopped_and_lists_cancelled_tasks():
    engine = ScriptedEngine(action, delay=lambda p: 0.002)
    got = Collector(10)
    d = RolloutDriver(engine, lambda t: CountingEnv(done_after=2), endless_tasks(), F, CFG, got)
    d.start_in_thread()
    assert d.is_running
    assert got.event.wait(WAIT), d.stats()
    d.stop(drain=False, timeout=WAIT)
    assert not d.is_running
    s = d.stats()
    assert s["finished"] >= 10 and s["in_flight"] == 0 and s["failed"] == 0 and s["error"] is None
    assert s["submitted"] == s["finished"] + s["cancelled"]  # no prompt is lost without a trace
    assert len({t.prompt_id for t in got.trajs}) == len(got.trajs) == s["finished"]
    assert {t.prompt_id for t in d.cancelled_tasks}.isdisjoint(t.prompt_id for t in got.trajs)
    assert engine.max_active <= CFG.max_concurrency
    assert got.threads == {"rollout-driver"}  # on_done runs on the driver's thread
    assert s["engine_idle_s"] >= 0.0


def test_driver_finishes_a_finite_task_list_and_counts_failures():
    got = Collector(6)

    def env_factory(t):
        return CountingEnv(done_after=2, raise_on_step=1 if t.prompt_id in ("p1", "p4") else None)

    d = RolloutDriver(ScriptedEngine(action), env_factory, [task(i) for i in range(6)], F, CFG, got, concurrency=2)
    d.start_in_thread()
    d.join(WAIT)
    s = d.stats()
    assert s["exhausted"] and (s["submitted"], s["finished"], s["failed"], s["cancelled"]) == (6, 6, 2, 0)
    assert sorted(t.prompt_id for t in got.trajs if t.status == "failed") == ["p1", "p4"]


def test_drain_stop_lets_episodes_in_flight_finish():
    gate = threading.Event()
    got = Collector(1)

    class GatedEnv(CountingEnv):
        async def step(self, action_text):
            import asyncio
            while not gate.is_set():  # holds every episode in flight until the test opens the gate
                await asyncio.sleep(0.005)
            return await super().step(action_text)

    d = RolloutDriver(ScriptedEngine(action), lambda t: GatedEnv(done_after=1), endless_tasks(), F, CFG, got)
    d.start_in_thread()
    d.pause_submissions()
    d.request_stop(drain=True)
    gate.set()
    d.join(WAIT)
    s = d.stats()
    assert s["cancelled"] == 0 and s["finished"] == s["submitted"] >= 1


def test_paused_driver_submits_nothing_until_resumed():
    got = Collector(2)
    d = RolloutDriver(ScriptedEngine(action), lambda t: CountingEnv(done_after=1), [task(0), task(1)], F, CFG, got)
    d.pause_submissions()  # before start: applied directly
    d.start_in_thread()
    assert d.stats()["submitted"] == 0 and d.stats()["paused"]
    d.resume_submissions()
    d.join(WAIT)
    assert d.stats()["finished"] == 2


def test_consumer_error_stops_the_driver_and_is_reraised():
    def on_done(traj):
        raise OSError("buffer is closed")

    d = RolloutDriver(ScriptedEngine(action), lambda t: CountingEnv(done_after=1), endless_tasks(), F, CFG, on_done)
    d.start_in_thread()
    with pytest.raises(RuntimeError, match="buffer is closed"):
        d.join(WAIT)
    assert not d.is_running


def test_run_coroutine_reaches_the_engine_on_the_driver_loop():
    engine = ScriptedEngine(action)
    gate = threading.Event()

    class Waiting(CountingEnv):
        async def reset(self, t):
            import asyncio
            while not gate.is_set():
                await asyncio.sleep(0.005)

    d = RolloutDriver(engine, lambda t: Waiting(done_after=1), endless_tasks(), F, CFG, Collector(1))
    d.start_in_thread()
    d.run_coroutine(engine.update_weights([], 4), timeout=WAIT)
    assert engine.version == 4
    gate.set()
    d.stop(timeout=WAIT)


def test_driver_argument_errors():
    with pytest.raises(ValueError, match="concurrency"):
        RolloutDriver(ScriptedEngine(action), CountingEnv, [], F, CFG, print, concurrency=0)
    with pytest.raises(TypeError, match="on_done"):
        RolloutDriver(ScriptedEngine(action), CountingEnv, [], F, CFG, None)
    d = RolloutDriver(ScriptedEngine(action), CountingEnv, [], F, CFG, print)
    with pytest.raises(RuntimeError, match="not started"):
        d.join(1)
    with pytest.raises(RuntimeError, match="not running"):
        d.run_coroutine(None)
