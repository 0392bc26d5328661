"""Where the rollout engines run, as seen by the trainer's lifecycle: the placement object.

``Placement`` is the embedded and disaggregated placements: the engines run beside the trainer (rank 0's
process, or ``vllm serve`` on rollout nodes), rollouts never pause, and every hook does nothing but
wait for the batch. ``trainer/colocated.py::ColocatedPlacement`` (``cluster.placement: colocated``): every trainer
rank hosts a shard of a vLLM engine and generation and training take turns on the same GPUs
(``rollout/colocate/cycle.py`` has the order and why); its hooks are the turns. The loop
(``trainer/loop.py``) calls the same hooks in the same order whatever the placement:

    start(actor, models)                    build the engine shards (colocated), load the actor into them
    wait_for_batch(step, take, ...)         rank 0's batch; colocated: every rank serves until it is there
    before_train()                          colocated: engines asleep, trainer state back on the device
    weight_push(...).push(version, step)    after an actor step: streamed by rank 0 (colocated: nothing)
    after_train(version, train_s)           colocated: trainer offloaded, new weights loaded, engines awake
    evaluate(rollout, out)                  held-out accuracy on the live engines (rank 0's figure)
    end_step(step, run_dir)                 colocated: the step's per-phase seconds and memory
    trainer_resident()                      checkpoints and the export need the trainer state on the device
    close()
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from megatron_sao.config import SAOConfig
from megatron_sao.weights.push import NoWeightPush, WeightPush


class Placement:
    """Embedded and disaggregated: the engines run apart from the trainer's turns, so nothing is done
    around a step and rollouts go on while it trains (module docstring for the hooks)."""

    def __init__(self, cfg: SAOConfig) -> None:
        self.cfg = cfg

    def start(self, actor, models: list) -> None:
        pass

    def wait_for_batch(self, step: int, take, should_stop, timeout_s: float):
        """Rank 0: ``take(timeout)`` from the buffer (None after ``timeout_s`` or once ``should_stop()``);
        the other ranks get None here and the batch from rank 0's broadcast."""
        return take(timeout_s) if take is not None else None

    def before_train(self) -> None:
        pass

    def after_train(self, version: int, train_s: float) -> dict:
        return {}

    def weight_push(self, actor, rollout, collectives) -> WeightPush | NoWeightPush:
        """How the actor's weights reach the engines after each actor step: streamed by rank 0."""
        r = self.cfg.rollout
        return WeightPush(actor, rollout, collectives, bucket_bytes=r.weight_sync_bucket_mb << 20,
                          policy_lag=self.cfg.trainer.policy_lag, check=r.weight_sync_check,
                          check_every=r.weight_sync_check_every)

    def evaluate(self, rollout, out: Path) -> float | None:
        """Rank 0 (the only one with a rollout side) runs the episodes over every live server; past
        run.eval_timeout_s they are cancelled and TimeoutError raised."""
        if rollout is None:
            return None
        from megatron_sao.trainer.evaluate import run_eval

        return run_eval(self.cfg, rollout, out_path=out)["accuracy"]

    def end_step(self, step: int, run_dir) -> dict:
        return {}

    def trainer_resident(self):
        return contextlib.nullcontext()

    @property
    def engines(self) -> list | None:
        """Rank 0's handles of engines the placement hosts (None: the rollout side builds its own)."""
        return None

    def close(self) -> None:
        pass
