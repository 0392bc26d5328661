"""The SAO training loop. `SAOTrainer.run` is the whole algorithm; everything else is plumbing.

Per step (DESIGN.md data flow):
  1. take the `batch_size` oldest finished trajectories (single rollout: one per prompt)
  2. critic values of every state -> skip-observation GAE: returns (critic lambda) and advantages
     (length-adaptive policy lambda)
  3. K critic steps on the fixed returns
  4. after the critic warm-up: one actor step with the DIS loss, then push weights (version + 1)
Rollouts never wait for the trainer except through admission control (rollout_driver.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_sao.algorithms import RunningMeanBaseline, logprob_mismatch
from megatron_sao.buffer import TrajectoryBuffer
from megatron_sao.config import SAOConfig, dump_config
from megatron_sao.trainer import components as C
from megatron_sao.trainer.console import Console
from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn
from megatron_sao.trainer.rollout_driver import PromptStream, ReplaySource, RolloutDriver, unit_of
from megatron_sao.trainer.run_dir import rng_state, set_rng_state
from megatron_sao.trainer.targets import compute_targets
from megatron_sao.trajectory import collate_padded

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite steps, dead rollout engine); a checkpoint was written."""


class TrainingInterrupted(RuntimeError):
    """Ctrl-C / SIGTERM: the current step finished, a checkpoint was written, the run ended."""


class SAOTrainer:
    def __init__(self, cfg: SAOConfig, resume: bool = False):
        self.cfg, a = cfg, cfg.algorithm
        self.ctx, self.run_dir = C.start_stage(cfg)
        self.rank0 = self.ctx.rank == 0
        if self.rank0:
            dump_config(cfg, self.run_dir.path / "config.yaml")
        self._barrier()
        self.model_dir = C.resolve_model_dir(cfg, self.run_dir.path) if self.rank0 else None
        self.model_dir = Path(self._broadcast(str(self.model_dir) if self.model_dir else None))
        self.actor = C.build_actor(cfg, self.model_dir, ctx=self.ctx)
        self.critic = C.build_critic(cfg, self.model_dir, ctx=self.ctx) if a.uses_critic else None
        self.baseline = RunningMeanBaseline(a.running_mean_window) if a.name == "running_mean" else None
        self.group = a.group_size if a.name in ("grpo", "grpo_dis") else 1
        self.warmup = a.critic_warmup_steps if a.uses_critic else 0
        self.step, self.version = 0, 0
        self.nonfinite = {"actor": 0, "critic": 0}  # skipped (NaN/inf) steps in a row, per model
        self.total = self.warmup + cfg.run.total_steps
        self.policy_loss, self.critic_loss = policy_loss_fn(a), critic_loss_fn()
        self.console = Console(cfg.run.console if self.rank0 else "none", total=self.total)
        self.wait_s = self.busy_s = 0.0
        self._lagged: deque = deque()  # trainer.policy_lag: (version, weights) not yet pushed
        self.buffer = self.driver = self.rollout = None
        if self.rank0:
            self.buffer = TrajectoryBuffer(cfg.buffer.batch_size, cfg.buffer.max_staleness, cfg.buffer.staleness_policy,
                                           directory=self.run_dir.buffer_dir, group_size=self.group)
        state = self._resume() if resume else None
        if self.rank0:
            self._start_rollouts(state)
        if state is not None and not cfg.trainer.replay:  # the engine starts from the base model
            self._post_resume_sync()

    # ------------------------------------------------------------------ the algorithm
    def _on_signal(self, signum, frame) -> None:
        if self._stop_requested:  # a second Ctrl-C: leave now, without a checkpoint
            raise KeyboardInterrupt
        self._stop_requested = True
        logger.warning("%s: finishing step %d, then writing a checkpoint (again to abort at once)",
                       signal.Signals(signum).name, self.step)

    def _stop_agreed(self) -> bool:
        """All ranks stop at the same step boundary, whichever of them saw the signal."""
        flag = torch.tensor([1.0 if self._stop_requested else 0.0])
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def run(self) -> None:
        self._stop_requested = False
        if threading.current_thread() is threading.main_thread():
            # SIGTERM too: SLURM sends it before preempting or cancelling a job.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._on_signal)
        try:
            while self.step < self.total:
                # Sorted by length so each micro-batch only pays for its own longest trajectory.
                tw = time.monotonic()
                trajs = sorted(self._next_batch(), key=lambda t: t.length)
                t0 = time.monotonic()
                batch = collate_padded(trajs, pad_id=0)
                fields = {k: v for k, v in batch.to_dict().items() if v.dim() == 2}
                fields["attention_mask"] = batch.attention_mask
                m: dict = {"step": self.step, "version": self.version, "time/wait_batch_s": t0 - tw}

                tv = time.monotonic()
                values = self.critic.values(fields) if self.critic is not None else None
                m["time/critic_forward_s"] = time.monotonic() - tv
                targets = compute_targets(batch, values, self.cfg.algorithm, self.baseline)
                m.update(targets.metrics)
                fields["advantages"] = targets.advantages
                if self.critic is not None:
                    fields["returns"] = targets.returns
                    tv = time.monotonic()
                    for _ in range(self.cfg.algorithm.critic_steps):
                        res = self.critic.train_step(fields, self.critic_loss)
                        self._check_finite(res, "critic")
                    m["time/critic_train_s"] = time.monotonic() - tv
                    m.update({f"critic/{k}": v for k, v in res.metrics.items()},
                             **{"critic/grad_norm": res.grad_norm})

                if self.step >= self.warmup:  # critic warm-up: the actor waits, rollouts go on
                    tv = time.monotonic()
                    lp = self.actor.logprobs(fields)
                    m["time/actor_forward_s"] = time.monotonic() - tv
                    lag0 = batch.action_mask & (batch.versions == self.version)
                    if lag0.any():
                        m["logprob_mismatch_lag0"] = float(logprob_mismatch(lp, batch.rollout_logprobs, lag0))
                    tv = time.monotonic()
                    res = self.actor.train_step(fields, self.policy_loss)
                    m["time/actor_train_s"] = time.monotonic() - tv
                    self._check_finite(res, "actor")
                    m.update({f"actor/{k}": v for k, v in res.metrics.items()}, **{"actor/grad_norm": res.grad_norm})
                    if not res.skipped:
                        self.version += 1
                        m["time/weight_sync_s"] = self._sync_weights()

                self.busy_s += time.monotonic() - t0
                self.step += 1
                if self.rank0:
                    self.driver.step_finished()
                self._log(m, trajs, batch, time.monotonic() - t0)
                if self._stop_agreed():
                    self.save()
                    raise TrainingInterrupted(f"stopped by a signal after step {self.step}; checkpoint written")
                if self.cfg.run.save_every and self.step % self.cfg.run.save_every == 0:
                    self.save()
            self.save()
            from megatron_sao.trainer.hf_export import export_hf_model

            export_hf_model(self.actor, self.model_dir, self.run_dir.path / "final_model")
        finally:
            self.close()

    # ------------------------------------------------------------------ batches
    def _next_batch(self):
        """Rank 0 waits for a batch and broadcasts it; a str instead says why there is none."""
        trajs = None
        if self.rank0:
            t0 = time.monotonic()
            trajs = self.buffer.take(self.step, self.version, timeout=self.cfg.rollout.timeout_s,
                                     should_stop=lambda: self.driver.error is not None or self._stop_requested)
            self.wait_s += time.monotonic() - t0
            if trajs is None:
                if self._stop_requested:
                    trajs = "interrupted"
                elif self.driver.error is not None:
                    trajs = f"the rollout driver died: {self.driver.error!r}"
                else:
                    trajs = (f"no batch of {self.cfg.buffer.batch_size} trajectories within rollout.timeout_s="
                             f"{self.cfg.rollout.timeout_s}s (finished {self.driver.finished}, failed "
                             f"{self.driver.failed}, in flight {len(self.driver.in_flight)})")
        trajs = self._broadcast(trajs)
        if trajs == "interrupted":
            self.save()
            raise TrainingInterrupted(f"stopped by a signal while waiting for step {self.step}'s batch; "
                                      "checkpoint written")
        if isinstance(trajs, str):
            self.save()
            raise TrainingStopped(f"rollout engine: {trajs}; checkpoint written at step {self.step}")
        return trajs

    def _check_finite(self, res, role: str) -> None:
        if not res.skipped:
            self.nonfinite[role] = 0
            return
        n = self.nonfinite[role] = self.nonfinite[role] + 1
        logger.warning("%s step %d: non-finite loss/grad, update skipped (%d in a row)", role, self.step, n)
        if n >= self.cfg.run.max_consecutive_nonfinite:
            self.save()
            raise TrainingStopped(f"{n} non-finite {role} steps in a row at step {self.step}; checkpoint written")

    def _sync_weights(self) -> float:
        if self.cfg.trainer.replay:
            return 0.0  # no rollout engine to feed
        t0 = time.monotonic()
        buckets = list(self.actor.export_hf_weights(self.cfg.rollout.weight_sync_bucket_mb << 20))
        version = self.version
        if self.cfg.trainer.policy_lag:  # staleness stress test: push the snapshot of policy_lag steps ago
            self._lagged.append((version, [[(n, t.clone()) for n, t in b] for b in buckets]))
            if len(self._lagged) <= self.cfg.trainer.policy_lag:
                return time.monotonic() - t0
            version, buckets = self._lagged.popleft()
        if self.rank0:
            self.driver.call(self.rollout.update_weights(buckets, version), timeout=self.cfg.rollout.timeout_s)
        return time.monotonic() - t0

    # ------------------------------------------------------------------ rollouts
    def _start_rollouts(self, state: dict | None) -> None:
        cfg = self.cfg
        if cfg.trainer.replay:
            # Fixed data: every trajectory was sampled by version 0, so a staleness bound would
            # drop them all once the policy moves; train on them and let DIS mask what drifted.
            self.buffer.policy = "keep"
            if state is not None:
                self.buffer.restore()
            self.driver = ReplaySource(cfg.trainer.replay, self.buffer.put, fresh=state is None)
            return
        self.rollout = C.build_rollout_engine(cfg, self.model_dir)
        from megatron_sao.rollout.chat import ChatFormatter

        formatter = ChatFormatter(C.load_tokenizer(cfg, self.model_dir))
        ahead = 0 if cfg.trainer.mode == "sync" else cfg.buffer.max_staleness
        drv = (state or {}).get("driver", {})
        in_buffer = {unit_of(t) for t in self.buffer.restore()} if state else set()
        requeue = [tuple(u) for u in drv.get("queued", []) + drv.get("in_flight", []) if tuple(u) not in in_buffer]
        self.driver = RolloutDriver(
            self.rollout, C.env_factory(cfg), PromptStream(C.train_tasks(cfg), cfg.run.seed), formatter,
            C.agent_loop_config(cfg), self.buffer.put, batch_size=cfg.buffer.batch_size, ahead=ahead,
            concurrency=cfg.rollout.concurrency, group_size=self.group, next_pos=drv.get("next_pos", 0),
            requeue=requeue, skip=in_buffer, step_offset=self.step)
        self.buffer.on_drop = self.driver.requeue
        self.driver.start()
        self.formatter = formatter

    def _post_resume_sync(self) -> None:
        buckets = list(self.actor.export_hf_weights(self.cfg.rollout.weight_sync_bucket_mb << 20))
        if self.rank0:
            self.driver.call(self.rollout.update_weights(buckets, self.version), timeout=self.cfg.rollout.timeout_s)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        state = {"step": self.step, "version": self.version, "nonfinite": self.nonfinite,
                 "driver": self.driver.state() if self.rank0 else None,
                 "baseline": self.baseline.state_dict() if self.baseline else None,
                 "buffer_stats": vars(self.buffer.stats) if self.rank0 else None, "rng": rng_state()}

        def parts(d: Path):
            self.actor.save(str(d / "actor"))
            if self.critic is not None:
                self.critic.save(str(d / "critic"))
        self.run_dir.save_checkpoint(self.step, parts, state, barrier=self._barrier)
        if self.rank0:
            self.buffer.release_consumed(self.step - 1)

    def _resume(self) -> dict | None:
        ckpt = self.run_dir.latest_checkpoint()
        if ckpt is None:
            logger.info("--resume: no checkpoint in %s, starting fresh", self.run_dir.ckpt_root)
            return None
        state = self.run_dir.load_trainer_state(ckpt)
        self.actor.load(str(ckpt / "actor"))
        if self.critic is not None:
            self.critic.load(str(ckpt / "critic"))
        self.step, self.version, self.nonfinite = state["step"], state["version"], dict(state["nonfinite"])
        if self.baseline is not None and state.get("baseline"):
            self.baseline.load_state_dict(state["baseline"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        self.run_dir.truncate_logs(self.step)
        logger.info("resumed from %s at step %d (policy version %d)", ckpt, self.step, self.version)
        return state

    # ------------------------------------------------------------------ logging
    def _log(self, m: dict, trajs, batch, step_s: float) -> None:
        if not self.rank0:
            return
        rewards = torch.tensor([t.reward for t in trajs])
        m.update({
            "wall_time": time.time(), "reward": float(rewards.mean()), "step_time_s": step_s,
            "tokens_per_s": float(batch.attention_mask.sum()) / max(step_s, 1e-9),
            "action_tokens": int(batch.action_mask.sum()), "mean_length": float(batch.lengths.float().mean()),
            "mean_turns": sum(t.num_turns for t in trajs) / len(trajs),
            "lag_histogram": self.buffer.stats.last_lag_histogram,
            "buffer/dropped_stale": self.buffer.stats.dropped_stale, "buffer/failed": self.buffer.stats.failed,
            "buffer/ready": len(self.buffer),
            "trainer_idle_fraction": self.wait_s / max(self.wait_s + self.busy_s, 1e-9),
            "rollout_idle_fraction": self.driver.engine_idle_fraction(),
        })
        started = [t.info["policy_step"] for t in trajs if "policy_step" in t.info]
        if started:  # trainer steps at which this batch's episodes started (non-stationary envs judge by it)
            m["rollout/policy_step_min"], m["rollout/policy_step_max"] = min(started), max(started)
        due = self.cfg.run.eval_every and (self.step % self.cfg.run.eval_every == 0 or self.step == self.total)
        if due and self.rollout is not None:
            te = time.monotonic()
            m["eval/accuracy"] = self.evaluate()
            m["time/eval_s"] = time.monotonic() - te
        self.run_dir.log_metrics(m, tensorboard=self.cfg.run.tensorboard)
        self.run_dir.log_batch(m["step"], trajs)
        self.console.update(m)

    def evaluate(self) -> float:
        from megatron_sao.trainer.evaluate import run_eval

        return run_eval(self.cfg, self.rollout, self.formatter, out_path=self.run_dir.path / "eval" /
                        f"step_{self.step:06d}.jsonl", call=self.driver.call)["accuracy"]

    # ------------------------------------------------------------------ distributed helpers
    def _broadcast(self, obj):
        if self.ctx.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _barrier(self) -> None:
        if self.ctx.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.driver is not None:
            try:
                if self.driver.error is None and self.rollout is not None:
                    self.driver.call(self.rollout.close(), timeout=30)
            except Exception as e:  # noqa: BLE001 - shutting down; report and go on
                logger.warning("closing the rollout engine failed: %r", e)
            self.driver.stop()
            self.driver = None
        if self.buffer is not None:
            self.buffer.close()
        self.console.close()
        self.run_dir.close()
