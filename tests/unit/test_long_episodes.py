"""Long trajectories are trained on: an episode that takes longer than 10 trainer steps reaches a
batch with the default config (keep and let DIS mask) and, under `drop`, after `max_stale_drops`.

Real parts: EpisodeDriver (admission control, requeue; rollout/episode_driver.py), TrajectoryBuffer built as the
trainer builds it, the agent loop, chat formatting and the toy calculator environment. At the boundary: a scripted
engine and an environment wrapper that holds one prompt's episode until the "trainer" (this test's
loop of take -> version + 1 -> step_finished) has finished 11 steps since the episode started.
"""

import asyncio

from megatron_sao.buffer import TrajectoryBuffer
from megatron_sao.config import load_config
from megatron_sao.envs import make_env
from megatron_sao.envs.toy_tool import ToyToolTasks
from megatron_sao.rollout.agent_loop import AgentLoopConfig
from megatron_sao.rollout.chat import ChatFormatter
from megatron_sao.rollout.engines.protocol import SamplingParams
from megatron_sao.rollout.episode_driver import EpisodeDriver
from megatron_sao.rollout.prompts import PromptStream
from megatron_sao.tokenizers.char_tokenizer import build_char_tokenizer
from tests.engine_fixtures import answering

SLOW_POS, SLOW_STEPS = 0, 11


class Trainer:
    steps = 0  # trainer steps finished (what the slow episode waits on)


class SlowForOnePrompt:
    """The toy env, except that the episode of stream position SLOW_POS (every run of it) takes
    SLOW_STEPS trainer steps: its first tool reply waits for them."""

    name = "toy_tool"

    def __init__(self):
        self.inner, self.slow = make_env("toy_tool"), False

    async def reset(self, task):
        self.slow = task.meta["data_pos"] == SLOW_POS
        await self.inner.reset(task)

    async def step(self, text):
        start = Trainer.steps
        while self.slow and Trainer.steps < start + SLOW_STEPS:
            await asyncio.sleep(0.002)
        return await self.inner.step(text)

    async def close(self):
        await self.inner.close()


def train_until_the_slow_prompt_is_trained(overrides, max_steps):
    """Run the driver + buffer as SAOTrainer wires them; returns (lag it was trained at, buffer)."""
    cfg = load_config(None, ["buffer.batch_size=2", "rollout.concurrency=4", *overrides])
    b = cfg.buffer
    Trainer.steps = 0
    fmt = ChatFormatter(build_char_tokenizer())
    engine = answering(fmt)  # `=0<|end|>` at once, tagged with the policy version it holds
    buf = TrajectoryBuffer(b.batch_size, b.max_staleness, b.staleness_policy, max_stale_drops=b.max_stale_drops)
    drv = EpisodeDriver(engine, lambda task: SlowForOnePrompt(), PromptStream(ToyToolTasks(200, seed=0), seed=0), fmt,
                        AgentLoopConfig(max_turns=2, max_total_tokens=256, max_new_tokens_per_turn=16,
                                        sampling=SamplingParams(max_new_tokens=16)),
                        buf.put, batch_size=b.batch_size, ahead=b.max_staleness, concurrency=cfg.rollout.concurrency)
    buf.on_drop = drv.requeue
    drv.start()
    try:
        for step in range(max_steps):
            batch = buf.take(step, engine.version, timeout=30)
            assert batch is not None, f"no batch at step {step}: {drv.error!r}"
            engine.version += 1  # the actor step and the weight sync
            Trainer.steps += 1
            drv.step_finished()
            slow = [t for t in batch if t.info["data_pos"] == SLOW_POS]
            if slow:
                return engine.version - 1 - slow[0].min_version(), buf
        return None, buf
    finally:
        drv.stop()


def test_an_episode_slower_than_ten_trainer_steps_is_trained_on_by_default():
    lag, buf = train_until_the_slow_prompt_is_trained([], max_steps=40)
    assert lag is not None, f"never trained on (dropped {buf.stats.dropped_stale} times)"
    assert lag >= SLOW_STEPS > load_config().buffer.max_staleness  # it arrived stale, and was kept
    assert buf.stats.dropped_stale == 0


def test_drop_policy_trains_it_after_max_stale_drops():
    lag, buf = train_until_the_slow_prompt_is_trained(["buffer.staleness_policy=drop", "buffer.max_stale_drops=2"],
                                                      max_steps=60)
    assert lag is not None and lag >= SLOW_STEPS
    assert buf.stats.dropped_stale == 2 and buf.stats.kept_after_drops == 1
