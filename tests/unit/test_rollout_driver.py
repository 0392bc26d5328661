"""RolloutDriver: admission control (sync = one batch per step), requeue to the front, and the
circuit breaker that stops a run whose rollout engine died. The engine is a scripted fake (the
boundary); the environment, tokenizer, chat formatting and agent loop are real."""

import time

from megatron_sao.envs.toy_tool import ToyToolTasks
from megatron_sao.envs import make_env
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engine import GenerationResult, SamplingParams
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer
from megatron_sao.trainer.rollout_driver import PromptStream, RolloutDriver


class FakeEngine:
    """Answers every turn with `=0<|end|>` (an answer, so each episode is one turn)."""

    def __init__(self, formatter, broken=False):
        self.version, self.broken, self.calls = 0, broken, 0
        self.ids = formatter.encode("=0") + [formatter.stop_token_ids[0]]

    async def generate(self, prompt_ids, sampling):
        self.calls += 1
        if self.broken:
            raise ConnectionError("engine at http://127.0.0.1:9 refused the connection")
        return GenerationResult(list(self.ids), [-0.5] * len(self.ids), [self.version] * len(self.ids), "stop")

    async def health(self):
        return not self.broken


def make_driver(batch_size=4, ahead=0, broken=False, concurrency=8):
    fmt = ChatFormatter(build_char_tokenizer())
    done = []
    engine = FakeEngine(fmt, broken)
    drv = RolloutDriver(engine, lambda task: make_env("toy_tool"), PromptStream(ToyToolTasks(50, seed=0), seed=0), fmt,
                        AgentLoopConfig(max_turns=2, max_total_tokens=64, max_new_tokens_per_turn=8,
                                        sampling=SamplingParams(max_new_tokens=8)),
                        done.append, batch_size=batch_size, ahead=ahead, concurrency=concurrency)
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


def test_dead_engine_stops_the_driver_with_a_clear_error():
    drv, done, engine = make_driver(batch_size=4, ahead=0, broken=True, concurrency=8)
    drv.start()
    try:
        assert wait_for(lambda: drv.error is not None)
        assert "unhealthy" in str(drv.error) and "refused the connection" in str(drv.error)
        assert all(not t.trainable for t in done) and len(done) >= drv.failure_threshold
        calls = engine.calls
        time.sleep(0.3)
        assert engine.calls == calls  # stopped, not spinning through the prompt stream
    finally:
        drv.stop()
