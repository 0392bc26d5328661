"""The SAO trainer's lifecycle around the algorithm. One step of the algorithm is
`trainer/step.py::sao_step` (critic values -> GAE targets -> K critic steps -> one DIS actor step);
`SAOTrainer.run` repeats it:

    while steps remain:
        batch   = _next_batch()          rank 0 takes the `batch_size` oldest finished trajectories from
                                         the buffer and broadcasts them (all ranks train on the same one)
        outcome = sao_step(batch)        the algorithm, collective on every rank
        if the actor stepped:  version + 1, weights.push() to every rollout server
        _end_step()                      evaluates when due, logs (rank 0), agrees on a stop (Ctrl-C /
                                         SIGTERM) and saves

Around the loop: build the models and the buffer, _resume() from the newest intact checkpoint,
_start_rollouts() (rank 0: `rollout/rollout_side.py::RolloutSide`, every server and the episode driver),
and at the end save(), the HF export and close(). Rollouts never wait for the trainer except through
admission control (rollout/episode_driver.py). Every collective that may follow a phase only rank 0 runs
goes through the rank-0 gate (`distributed/gated.py`).

Where the engines run is the placement's business (`trainer/placement.py`): the loop calls its hooks
(wait for the batch, before/after the train step, evaluate, end of step) the same way for every
placement; only the colocated one does something in them.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from megatron_sao.algorithms import RunningMeanBaseline
from megatron_sao.buffer import TrajectoryBuffer
from megatron_sao.config import SAOConfig, to_dict
from megatron_sao.distributed.gated import GatedCollectives
from megatron_sao.errors import TrainingInterrupted, TrainingStopped
from megatron_sao.megatron import writer_results
from megatron_sao.megatron.async_saves import AsyncSaves
from megatron_sao.models.builtin import resolve_model_dir
from megatron_sao.rollout.prompts import complete_units
from megatron_sao.rollout.replay import ReplaySource
from megatron_sao.trainer import checkpoints as ckpts
from megatron_sao.trainer import colocated as colo
from megatron_sao.trainer import components as C
from megatron_sao.trainer.console import Console
from megatron_sao.trainer.hf_export import export_hf_model, export_step
from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn
from megatron_sao.trainer.placement import Placement
from megatron_sao.trainer.run_dir import rng_state, set_rng_state
from megatron_sao.trainer.step import sao_step
from megatron_sao.trainer.stopping import NonFiniteGuard
from megatron_sao.trainer.targets import mean_return
from megatron_sao.trajectory import collate_padded
from megatron_sao.weights.push import NoWeightPush

__all__ = ["SAOTrainer"]

logger = logging.getLogger(__name__)



def take_batch(buffer, step: int, version: int, timeout: float, should_stop: Callable[[], bool],
               awaiting_server: Callable[[], bool]):
    """Rank 0's batch wait: ``buffer.take`` until ``timeout`` (rollout.timeout_s) passes with no
    trajectory arriving, None once ``should_stop()``. The timeout is a liveness bound, not a batch
    deadline: a batch of 128K-token trajectories may take longer than it to fill, and every arrival shows
    the rollouts are alive. While ``awaiting_server()`` (no rollout server in service, one still starting
    or rollout.server_deadline_s pending) it does not run at all: it counts from when a server is back, and
    past the deadline the rollout side's error is what stops the wait."""
    if timeout <= 0:
        return buffer.take(step, version, timeout=timeout, should_stop=should_stop)
    deadline = time.monotonic() + timeout
    received = buffer.stats.received
    awaiting = warned = False
    while True:
        left = deadline - time.monotonic()
        batch = buffer.take(step, version, timeout=min(max(left, 0.0), 1.0), should_stop=should_stop)
        if batch is not None or should_stop():
            return batch
        if buffer.stats.received != received:  # a trajectory arrived: the whole timeout from now
            received, deadline = buffer.stats.received, time.monotonic() + timeout
        if awaiting_server():
            awaiting = True
            if not warned:
                logger.warning("step %d: no rollout server in service; the batch wait goes on until one is up or "
                               "back (rollout.server_start_timeout_s, rollout.server_deadline_s), then "
                               "rollout.timeout_s=%gs", step, timeout)
                warned = True
        elif awaiting:  # a server is back: the whole timeout from now
            awaiting, deadline = False, time.monotonic() + timeout
        elif time.monotonic() >= deadline:
            return None


class SAOTrainer:
    """Holds the run: actor, critic, buffer, rollout side, step and policy version (module docstring)."""

    def __init__(self, cfg: SAOConfig, resume: bool = False, overwrite: bool = False):
        self.cfg, a = cfg, cfg.algorithm
        colo.check_colocated(cfg)  # before anything loads: a colocated job that cannot run says why now
        self.ctx, self.run_dir = C.start_stage(cfg)
        self.rank0 = self.ctx.rank == 0
        self.collectives = GatedCollectives(self.ctx)
        if self.rank0:
            self.run_dir.start_train(overwrite=overwrite)
        if self.rank0 and not resume:  # a resume writes its config once it has resumed (below)
            self.run_dir.write_config(cfg, keep_previous=False)
            self.run_dir.configure_scalars(cfg.run.tensorboard, cfg.run.wandb, cfg.run.name, to_dict(cfg))
        self.collectives.barrier()
        self.model_dir = resolve_model_dir(cfg.model.path, self.run_dir.path, cfg.run.seed) if self.rank0 else None
        self.model_dir = Path(self.collectives.broadcast(str(self.model_dir) if self.model_dir else None))
        C.check_trainer_memory(cfg, self.model_dir, self.ctx)
        writer_results.start_server()  # forked while this process is small: it lives as long as the trainer
        self.actor = C.build_actor(cfg, self.model_dir, ctx=self.ctx)
        self.critic = C.build_critic(cfg, self.model_dir, ctx=self.ctx) if a.uses_critic else None
        self.models = [m for m in (self.actor, self.critic) if m is not None]
        self.baseline = RunningMeanBaseline(a.running_mean_window) if a.name == "running_mean" else None
        self.group = a.group_size if a.uses_groups else 1
        self.warmup = a.warmup_steps
        self.step, self.version = 0, 0
        self.checkpointer = ckpts.Checkpointer(
            self.run_dir.ckpt_root, is_writer=self.rank0, asynchronous=cfg.run.async_save,
            barrier=self.collectives.barrier, broadcast=self.collectives.broadcast,
            gate=self.collectives.wait_for_rank0, saves=AsyncSaves() if cfg.run.async_save else None)
        self.nonfinite = NonFiniteGuard(cfg.run.max_consecutive_nonfinite, self.save)
        self.total = self.warmup + cfg.run.total_steps
        self.policy_loss, self.critic_loss = policy_loss_fn(a), critic_loss_fn()
        self.console = Console(cfg.run.console if self.rank0 else "none", total=self.total)
        self.wait_s = self.busy_s = 0.0
        self.placement = (colo.ColocatedPlacement(cfg, self.model_dir, self.ctx) if colo.is_colocated(cfg)
                          else Placement(cfg))
        self.weights = NoWeightPush()
        # Rank 0's source of trajectories: the RolloutSide (every engine, the episode driver, weight
        # sync), or the ReplaySource of trainer.replay. None on the other ranks.
        self.buffer = self.rollout = None
        if self.rank0:
            self.buffer = TrajectoryBuffer(cfg.buffer.batch_size, cfg.buffer.max_staleness, cfg.buffer.staleness_policy,
                                           directory=self.run_dir.buffer_dir, group_size=self.group,
                                           max_stale_drops=cfg.buffer.max_stale_drops)
        state = self._resume() if resume else None
        # critic.value_head_bias mean_return: a head drawn fresh for this run starts at the first batch's mean return.
        self.bias_from_first_batch = (state is None and self.critic is not None and self.critic.fresh_value_head
                                      and cfg.critic.value_head_bias == "mean_return")
        if self.rank0 and resume:  # a failed resume leaves the run's config.yaml as the run wrote it
            kept = self.run_dir.write_config(cfg, keep_previous=True)  # (checked in train.preflight)
            if kept is not None:
                logger.info("resumed with other settings: the run's previous config is kept as %s", kept.name)
        self._start_rollouts(state)
        if state is not None and not cfg.trainer.replay:  # the engine starts from the base model
            # rank 0 started the rollout engines alone: meet it outside the export's collectives
            self.collectives.barrier()
            self.weights.push_resumed(self.version, self.step)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        self._stop_requested = False
        if threading.current_thread() is threading.main_thread():
            # SIGTERM too: SLURM sends it before preempting or cancelling a job.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._stop_requested:
            if signum == signal.SIGINT:  # a second Ctrl-C: leave now, without a checkpoint
                raise KeyboardInterrupt
            # A repeated SIGTERM is the same request from another sender (scancel signals every
            # process of the step, and torchrun passes its own on): keep finishing the step.
            logger.warning("SIGTERM again: still finishing step %d and its checkpoint", self.step)
            return
        self._stop_requested = True
        logger.warning("%s: finishing step %d, then writing a checkpoint (again to abort at once)",
                       signal.Signals(signum).name, self.step)

    def _stop_agreed(self) -> bool:
        """All ranks stop at the same step boundary, whichever of them saw the signal (rank 0 may
        still push weights or evaluate: the agreement waits for it at the gate)."""
        return self.collectives.any_rank(self._stop_requested, "the stop agreement")

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self._install_signal_handlers()
        try:
            while self.step < self.total:
                # In the buffer's order: the engines plan ranks and micro-batches themselves
                # (megatron/batching.py) and hand their outputs back in this order.
                tw = time.monotonic()
                trajs = self._next_batch()
                wait_s = time.monotonic() - tw
                self.placement.before_train()  # colocated: engines asleep, trainer state on the device
                t0 = time.monotonic()
                batch = collate_padded(trajs, pad_id=0)
                if self.bias_from_first_batch:
                    self.critic.set_value_head_bias(mean_return(batch, self.cfg.algorithm))
                    self.bias_from_first_batch = False
                outcome = sao_step(batch, self.actor, self.critic, self.cfg.algorithm,
                                   policy_loss=self.policy_loss, critic_loss=self.critic_loss, version=self.version,
                                   train_actor=self.step >= self.warmup,  # critic warm-up: the actor waits
                                   baseline=self.baseline,
                                   check=lambda res, role: self.nonfinite.check(res, role, self.step))
                m = {"step": self.step, "version": self.version, "time/wait_batch_s": wait_s, **outcome.metrics}
                if outcome.actor_updated:
                    self.version += 1
                    m["time/weight_sync_s"] = self.weights.push(self.version, self.step)
                # colocated: trainer offloaded, the new weights loaded in-process, engines awake
                m.update(self.placement.after_train(self.version, time.monotonic() - t0))
                self._end_step(m, trajs, batch, t0)
            self.save()
            with self.placement.trainer_resident():
                export_hf_model(self.actor, self.model_dir, self.run_dir.path / "final_model")
        finally:
            self.close()

    def _end_step(self, m: dict, trajs, batch, t0: float) -> None:
        """After a step: count it, evaluate when due, log it, stop on an agreed signal or save when due
        (checkpoints hold whole steps only)."""
        self.busy_s += time.monotonic() - t0
        self.step += 1
        if self.rank0:
            self.rollout.step_finished()  # admission: the next batch's episodes may start
        step_s = time.monotonic() - t0
        if self._eval_due(self.step):  # while the next batch's episodes run
            m.update(self._evaluate())
        m.update(self.placement.end_step(self.step - 1, self.run_dir))  # colocated: seconds and memory per phase
        if self.cfg.run.export_every and self.step % self.cfg.run.export_every == 0:
            m["time/export_s"] = self._export()
        m.update(self.checkpointer.take_metrics())  # the latest save's blocked seconds, a commit since the last step
        self._log(m, trajs, batch, step_s)
        if self._stop_agreed():
            self.save()
            raise TrainingInterrupted(f"stopped by a signal after step {self.step}; checkpoint written")
        self.checkpointer.poll()  # commits an asynchronous checkpoint once every rank has written it
        if self.cfg.run.save_every and self.step % self.cfg.run.save_every == 0:
            self.save(final=False)

    # ------------------------------------------------------------------ batches
    def _next_batch(self):
        """Rank 0 waits for a batch and broadcasts it; a str instead says why there is none."""
        t0 = time.monotonic()
        take = None
        if self.rank0:
            def take(timeout: float):
                return take_batch(self.buffer, self.step, self.version, timeout, should_stop, self._awaiting_server)

        def should_stop() -> bool:
            return (self.rank0 and (self.rollout.error is not None or self._rejoin_due())) or self._stop_requested
        trajs = self.placement.wait_for_batch(self.step, take, should_stop, self.cfg.rollout.timeout_s)
        if self.rank0:
            self.wait_s += time.monotonic() - t0
            if trajs is None:
                if self._stop_requested:
                    trajs = "interrupted"
                elif self.rollout.error is not None:
                    trajs = f"the rollout driver died: {self.rollout.error!r}"
                elif self._rejoin_due():
                    trajs = "rejoin"
                else:
                    waiting = getattr(self.rollout, "waiting_on", lambda: "")()  # a hung environment, named
                    trajs = (f"no batch of {self.cfg.buffer.batch_size} trajectories within rollout.timeout_s="
                             f"{self.cfg.rollout.timeout_s}s (finished {self.rollout.finished}, failed "
                             f"{self.rollout.failed}, in flight {len(self.rollout.in_flight)})"
                             + (f"; {waiting}" if waiting else ""))
        trajs = self.collectives.broadcast(trajs)
        if trajs == "interrupted":
            self.save()
            raise TrainingInterrupted(f"stopped by a signal while waiting for step {self.step}'s batch; "
                                      "checkpoint written")
        if trajs == "rejoin":
            # No server in service and a restarted one answers /health: it gets the current weights now
            # (every rank: the export is collective), then the wait goes on (rollout/server_pool.py).
            self.weights.push_resumed(self.version, self.step)
            return self._next_batch()
        if isinstance(trajs, str):
            self.save()
            raise TrainingStopped(f"rollouts: {trajs}; checkpoint written at step {self.step}")
        return trajs

    def _rejoin_due(self) -> bool:
        return bool(getattr(self.rollout, "needs_rejoin", False))

    def _awaiting_server(self) -> bool:
        return bool(getattr(self.rollout, "awaiting_server", False))

    # ------------------------------------------------------------------ rollouts
    def _start_rollouts(self, state: dict | None) -> None:
        """The placement's engines (every rank; colocated only), then rank 0's rollout side and the
        placement's weight push (colocated: none, every rank loads its engine shard after the step)."""
        cfg = self.cfg
        if cfg.trainer.replay:
            if self.rank0:
                # Fixed data: every trajectory was sampled by version 0, so a staleness bound would
                # drop them all once the policy moves; train on them and let DIS mask what drifted.
                self.buffer.policy = "keep"
                if state is not None:
                    self.buffer.restore()
                self.rollout = ReplaySource(cfg.trainer.replay, self.buffer.put, fresh=state is None)
            return
        self.placement.start(self.actor, self.models)
        if self.rank0:
            in_buffer, partial = complete_units(self.buffer.restore()) if state else (set(), [])
            if partial:  # segments of a harness episode whose last file was never written: it runs again
                self.buffer.set_aside(partial, "its episode's end was not written before the run stopped")
            self.rollout = C.build_rollout_side(cfg, self.model_dir, self.buffer.put, group_size=self.group,
                                                state=state, in_buffer=in_buffer, step_offset=self.step,
                                                engines=self.placement.engines)
            self.buffer.on_drop = self.rollout.requeue
            self.rollout.start()
        self.weights = self.placement.weight_push(self.actor, self.rollout, self.collectives)

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return not self.cfg.trainer.replay and (
            (bool(every) and (step % every == 0 or step == self.total)) or step in self.cfg.run.eval_at)

    def _evaluate(self) -> dict:
        """Held-out accuracy on the live engines (rank 0's figure; colocated: every rank serves). An
        evaluation past run.eval_timeout_s is abandoned, not fatal: a stuck rollout tier stops the next
        batch wait."""
        te = time.monotonic()
        out = self.run_dir.path / "eval" / f"step_{self.step:06d}.jsonl"
        try:
            m = {"eval/accuracy": self.placement.evaluate(self.rollout, out)}
        except TimeoutError as e:
            logger.error("step %d: %s; training goes on", self.step, e)
            m = {"eval/timed_out": 1.0}
        m["time/eval_s"] = time.monotonic() - te
        return m

    # ------------------------------------------------------------------ checkpoints
    def save(self, final: bool = True) -> None:
        """A checkpoint of the current step (trainer/checkpoints.py::Checkpointer); `final` (the run ends
        after it) waits until it is written and committed, a periodic one (run.async_save) does not."""
        if final and self.checkpointer.last_step == self.step:  # the periodic save of the last step: the same state
            self.checkpointer.wait()
            return
        state = {"step": self.step, "version": self.version, "nonfinite": self.nonfinite.in_a_row,
                 "driver": self.rollout.state() if self.rank0 else None,
                 "baseline": self.baseline.state_dict() if self.baseline else None,
                 "buffer_stats": vars(self.buffer.stats) if self.rank0 else None, "rng": rng_state(),
                 # The trajectory files this checkpoint has trained on: resume never loads them
                 # again, whether or not the release below happened before a kill.
                 "covered": self.buffer.covered() if self.rank0 else None}

        def parts(d: Path) -> list:
            requests = [engine.save(str(d / name), asynchronous=self.cfg.run.async_save)
                        for name, engine in self._engines().items()]
            return [r for r in requests if r is not None]

        def on_commit(previous: Path | None) -> None:
            if self.rank0 and previous is not None:
                # Release only what the older kept checkpoint covers too: a fallback to it (the newest
                # one damaged) must still find the trajectories trained after it.
                self.buffer.release_consumed(ckpts.step_of(previous) - 1)
        with self.placement.trainer_resident():
            self.checkpointer.save(self.step, parts, state, on_commit)
        if final:
            self.checkpointer.wait()

    def _engines(self) -> dict:
        return {name: e for name, e in (("actor", self.actor), ("critic", self.critic)) if e is not None}

    def _export(self) -> float:
        """run.export_every: the actor as an HF checkpoint in <run>/exports/step_N (collective)."""
        t0 = time.monotonic()
        with self.placement.trainer_resident():
            export_step(self.actor, self.model_dir, self.run_dir.exports_dir, self.step)
        return time.monotonic() - t0

    def _resume(self) -> dict | None:
        """Load the newest intact checkpoint (falling back past damaged ones, which are named and set
        aside); with none at all, clear what an earlier attempt logged and start fresh."""
        root = self.run_dir.ckpt_root
        ckpt = ckpts.load_newest_intact(root, self.collectives, self.ctx.rank, self._engines())
        if ckpt is None:
            if self.rank0:
                self.run_dir.clear_training()
            logger.warning("--resume: no checkpoint in %s; starting fresh (what an earlier attempt logged "
                           "and buffered is removed: no checkpoint covers it)", root)
            return None
        state = ckpts.load_trainer_state(ckpt)
        self.step, self.version = state["step"], state["version"]
        self.nonfinite.in_a_row = dict(state["nonfinite"])
        if self.baseline is not None and state.get("baseline"):
            self.baseline.load_state_dict(state["baseline"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        if self.rank0:
            self.buffer.restore({tid: step for tid, step in state.get("covered") or []}, unusable=self._unusable)
        self.run_dir.truncate_logs(self.step)
        logger.info("resumed from %s at step %d (policy version %d)", ckpt, self.step, self.version)
        return state

    def _unusable(self, traj) -> str | None:
        """Why a restored trajectory cannot be trained on by this actor (the buffer sets it aside): sampled
        after the checkpoint by a policy version this resumed run does not have (the killed attempt's
        steps after it; its lag cannot be known, its version labels would collide with the versions this
        run makes again, and its episode runs again), or routes of another model (a buffer file of another
        run), which the train step would refuse."""
        if (newest := traj.max_version()) > self.version:
            return (f"was sampled by policy version {newest}, newer than the checkpoint's {self.version} "
                    "(an earlier attempt's, which this resumed run does not have); its episode runs again")
        s = self.actor.spec
        return traj.routes_problem(s.num_layers, s.moe_topk, s.num_experts) if s.is_moe else None

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
            "buffer/kept_after_drops": self.buffer.stats.kept_after_drops,
            "buffer/groups_with_failures": self.buffer.stats.groups_with_failures,
            "buffer/ready": len(self.buffer),
            "trainer_idle_fraction": self.wait_s / max(self.wait_s + self.busy_s, 1e-9),
            "rollout_idle_fraction": self.rollout.engine_idle_fraction(),
        })
        started = [t.info["policy_step"] for t in trajs if "policy_step" in t.info]
        if started:  # trainer steps at which this batch's episodes started (non-stationary envs judge by it)
            m["rollout/policy_step_min"], m["rollout/policy_step_max"] = min(started), max(started)
        m.update(self.rollout.metrics())  # per server: episodes, weight version, health, sync check
        self.run_dir.log_metrics(m)
        self.run_dir.log_batch(m["step"], trajs)
        self.console.update(m)

    def close(self) -> None:
        self.checkpointer.abort()  # after an error only: a finished run waited for its last checkpoint
        if self.rollout is not None:
            self.rollout.close()  # every engine's sessions and transfer groups, then the loop
            self.rollout = None
        self.placement.close()
        if self.buffer is not None:
            self.buffer.close()
        self.console.close()
        self.run_dir.close()
