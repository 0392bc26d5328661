"""RolloutDriver: admission control (sync = one batch per step), requeue to the front, and the
circuit breaker that stops a run whose rollout engine died, and the trainer step reaching the
environment (`policy_step`). The engine is a scripted fake (the boundary); the environment,
tokenizer, chat formatting and agent loop are real."""

import time

from megatron_sao.envs.style_shift import load_style_tasks
from megatron_sao.envs.toy_tool import ToyToolTasks
from megatron_sao.envs import make_env
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engine import GenerationResult, SamplingParams
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer
from megatron_sao.trainer.rollout_driver import PromptStream, RolloutDriver


class FakeEngine:
    """Answers every turn with `answer<|end|>` (`=0`: a toy answer, so each episode is one turn)."""

    def __init__(self, formatter, broken=False, answer="=0"):
        self.version, self.broken, self.calls = 0, broken, 0
        self.ids = formatter.encode(answer) + [formatter.stop_token_ids[0]]

    async def generate(self, prompt_ids, sampling):
        self.calls += 1
        if self.broken:
            raise ConnectionError("engine at http://127.0.0.1:9 refused the connection")
        return GenerationResult(list(self.ids), [-0.5] * len(self.ids), [self.version] * len(self.ids), "stop")

    async def health(self):
        return not self.broken


def make_driver(batch_size=4, ahead=0, broken=False, concurrency=8, env="toy_tool", answer="=0", **driver_kw):
    fmt = ChatFormatter(build_char_tokenizer())
    done = []
    engine = FakeEngine(fmt, broken, answer)
    if env == "toy_tool":
        tasks, factory = ToyToolTasks(50, seed=0), (lambda task: make_env("toy_tool"))
    else:  # style_shift, its style switching every trainer step: cute, classical, cute, ...
        tasks, factory = load_style_tasks(50, seed=0), (
            lambda task: make_env("style_shift", switch_every=1, styles=["cute", "classical"]))
    drv = RolloutDriver(engine, factory, PromptStream(tasks, seed=0), fmt,
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
