"""The SAO trainer's lifecycle around the algorithm. One step of the algorithm is
`trainer/step.py::sao_step` (critic values -> GAE targets -> K critic steps -> one DIS actor step);
`SAOTrainer.run` repeats it:

    while steps remain:
        batch   = _next_batch()      rank 0 takes the `batch_size` oldest finished trajectories from
                                     the buffer and broadcasts them (all ranks train on the same one)
        outcome = sao_step(batch)    the algorithm, collective on every rank
        if the actor stepped:  version + 1, _sync_weights() -> _push() to every rollout server
        _end_step()                  logs (_log, rank 0), agrees on a stop (Ctrl-C / SIGTERM) and saves

Around the loop: build the models and the buffer, _resume() from the newest intact checkpoint,
_start_rollouts() (rank 0: `rollout/rollout_side.py::RolloutSide`, every server and the episode driver),
and at the end save(), the HF export and close(). Rollouts never wait for the trainer except through
admission control (rollout/episode_driver.py). Every collective that may follow a phase only rank 0 runs
goes through the rank-0 gate (the distributed helpers at the bottom).

Colocated placement (`cluster.placement: colocated`, `trainer/colocated.py`): every rank hosts a vLLM
engine shard, `_next_batch` first serves the engines on every rank until rank 0 holds a batch, and
`_before_train` / `_after_train` bracket the step with the memory dance of rollout/colocate/cycle.py
(engine asleep, trainer onloaded; trainer offloaded, new weights loaded in-process, engine awake).
Elsewhere those hooks do nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_sao.algorithms import RunningMeanBaseline
from megatron_sao.buffer import TrajectoryBuffer
from megatron_sao.config import SAOConfig, dump_config
from megatron_sao.errors import UserError
from megatron_sao.trainer import checkpoints as ckpts
from megatron_sao.trainer import colocated as colo
from megatron_sao.trainer import components as C
from megatron_sao.trainer.console import Console
from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn
from megatron_sao.rollout.prompts import unit_of
from megatron_sao.rollout.replay import ReplaySource
from megatron_sao.trainer.run_dir import rng_state, set_rng_state
from megatron_sao.trainer.step import sao_step
from megatron_sao.trajectory import collate_padded

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite steps, dead rollout engine); a checkpoint was written."""


class TrainingInterrupted(RuntimeError):
    """Ctrl-C / SIGTERM: the current step finished, a checkpoint was written, the run ended."""


class SAOTrainer:
    """Holds the run: actor, critic, buffer, rollout side, step and policy version (module docstring)."""

    def __init__(self, cfg: SAOConfig, resume: bool = False, overwrite: bool = False):
        self.cfg, a = cfg, cfg.algorithm
        colo.check_colocated(cfg)  # before anything loads: a colocated job that cannot run says why now
        self.ctx, self.run_dir = C.start_stage(cfg)
        self.rank0 = self.ctx.rank == 0
        if self.rank0:
            self.run_dir.start_train(overwrite=overwrite)
        if self.rank0:
            dump_config(cfg, self.run_dir.path / "config.yaml")
        self._barrier()
        self.model_dir = C.resolve_model_dir(cfg, self.run_dir.path) if self.rank0 else None
        self.model_dir = Path(self._broadcast(str(self.model_dir) if self.model_dir else None))
        C.check_trainer_memory(cfg, self.model_dir, self.ctx)
        self.actor = C.build_actor(cfg, self.model_dir, ctx=self.ctx)
        self.critic = C.build_critic(cfg, self.model_dir, ctx=self.ctx) if a.uses_critic else None
        self.baseline = RunningMeanBaseline(a.running_mean_window) if a.name == "running_mean" else None
        self.group = a.group_size if a.uses_groups else 1
        self.warmup = a.critic_warmup_steps if a.uses_critic else 0
        self.step, self.version = 0, 0
        self.nonfinite = {"actor": 0, "critic": 0}  # skipped (NaN/inf) steps in a row, per model
        self.total = self.warmup + cfg.run.total_steps
        self.policy_loss, self.critic_loss = policy_loss_fn(a), critic_loss_fn()
        self.console = Console(cfg.run.console if self.rank0 else "none", total=self.total)
        self.wait_s = self.busy_s = 0.0
        self._lagged: deque = deque()  # trainer.policy_lag: (version, weights) not yet pushed
        self.buffer = self.driver = self.rollout = self.colocated = None
        if self.rank0:
            self.buffer = TrajectoryBuffer(cfg.buffer.batch_size, cfg.buffer.max_staleness, cfg.buffer.staleness_policy,
                                           directory=self.run_dir.buffer_dir, group_size=self.group,
                                           max_stale_drops=cfg.buffer.max_stale_drops)
        state = self._resume() if resume else None
        if self.rank0 or colo.is_colocated(cfg):  # colocated: every rank hosts an engine shard
            self._start_rollouts(state)
        if state is not None and not cfg.trainer.replay:  # the engine starts from the base model
            self._barrier()  # rank 0 started the rollout engines alone: meet it outside the export's collectives
            self._post_resume_sync()

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        self._stop_requested = False
        if threading.current_thread() is threading.main_thread():
            # SIGTERM too: SLURM sends it before preempting or cancelling a job.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._stop_requested:  # a second Ctrl-C: leave now, without a checkpoint
            raise KeyboardInterrupt
        self._stop_requested = True
        logger.warning("%s: finishing step %d, then writing a checkpoint (again to abort at once)",
                       signal.Signals(signum).name, self.step)

    def _stop_agreed(self) -> bool:
        """All ranks stop at the same step boundary, whichever of them saw the signal."""
        flag = torch.tensor([1.0 if self._stop_requested else 0.0], device=self.ctx.device)
        if self.ctx.world_size > 1:
            self._wait_for_rank0("the stop agreement")  # rank 0 may still push weights or evaluate
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self._install_signal_handlers()
        try:
            while self.step < self.total:
                # Sorted by length so each micro-batch only pays for its own longest trajectory.
                tw = time.monotonic()
                trajs = sorted(self._next_batch(), key=lambda t: t.length)
                wait_s = time.monotonic() - tw
                self._before_train()
                t0 = time.monotonic()
                batch = collate_padded(trajs, pad_id=0)
                outcome = sao_step(batch, self.actor, self.critic, self.cfg.algorithm,
                                   policy_loss=self.policy_loss, critic_loss=self.critic_loss, version=self.version,
                                   train_actor=self.step >= self.warmup,  # critic warm-up: the actor waits
                                   baseline=self.baseline, check=self._check_finite)
                m = {"step": self.step, "version": self.version, "time/wait_batch_s": wait_s, **outcome.metrics}
                if outcome.actor_updated:
                    self.version += 1
                    m["time/weight_sync_s"] = self._sync_weights()
                m.update(self._after_train(time.monotonic() - t0))  # colocated: offload, reload, wake
                self._end_step(m, trajs, batch, t0)
            self.save()
            from megatron_sao.trainer.hf_export import export_hf_model

            with self._trainer_on_device():
                export_hf_model(self.actor, self.model_dir, self.run_dir.path / "final_model")
        finally:
            self.close()

    def _end_step(self, m: dict, trajs, batch, t0: float) -> None:
        """After a step: count it, log it, stop on an agreed signal or save when due (checkpoints
        hold whole steps only)."""
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

    # ------------------------------------------------------------------ batches
    def _next_batch(self):
        """Rank 0 waits for a batch and broadcasts it; a str instead says why there is none."""
        trajs = None
        t0 = time.monotonic()
        served = self._rollout_phase()
        if self.rank0:
            if self.colocated is not None:
                trajs = served
            else:
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
        """Stream the actor's weights to every rollout server as `self.version` (all ranks: the export
        runs collectives). Rank 0 never holds more than two buckets (RolloutSide.push_weights)."""
        if self.cfg.trainer.replay or self.colocated is not None:
            return 0.0  # no rollout engine to feed / colocated: every rank loads its shard after the step
        t0 = time.monotonic()
        buckets = self.actor.export_hf_weights(self.cfg.rollout.weight_sync_bucket_mb << 20)
        version = self.version
        if self.cfg.trainer.policy_lag:
            lagged = self._lagged_snapshot(buckets, version)
            if lagged is None:
                return time.monotonic() - t0
            version, buckets = lagged
        self._push(buckets, version)
        return time.monotonic() - t0

    def _lagged_snapshot(self, buckets, version: int):
        """trainer.policy_lag (a CPU staleness stress test): keep an explicit CPU copy of this version's
        weights and return the (version, buckets) of `policy_lag` steps ago, or None while there is
        none. By design this holds policy_lag + 1 full copies of the model in host memory; the config
        refuses it for bf16/fp16 models and cluster placements (config.validate)."""
        snapshot = [[(n, t.detach().to("cpu", copy=True)) for n, t in b] for b in buckets]
        self._lagged.append((version, snapshot))
        if len(self._lagged) <= self.cfg.trainer.policy_lag:
            return None
        version, snapshot = self._lagged.popleft()
        return version, iter(snapshot)

    def _push(self, buckets, version: int) -> None:
        check = self._weight_check_reference() if self.cfg.rollout.weight_sync_check else {}
        error = None
        if self.rank0:
            try:
                m = self.rollout.push_weights(buckets, version, **check)
                logger.info("weights v%d -> %d server(s): %.2fs, %d buckets, %.1f MB", version,
                            len(m.per_engine_seconds), m.seconds, m.buckets, m.bytes / 2**20)
            except Exception as e:  # noqa: BLE001 - every rank must learn it, or they wait forever
                error = f"{type(e).__name__}: {e}"
        else:
            for _ in buckets:  # the export's collectives pair with rank 0's
                pass
        error = self._broadcast(error)
        if error is not None:
            # No checkpoint here: the actor has stepped but no server holds its weights; the last
            # checkpoint (and the post-resume sync) is the consistent state to go back to.
            raise TrainingStopped(f"weight sync v{version} failed at step {self.step}: {error}")

    def _weight_check_reference(self) -> dict:
        """rollout.weight_sync_check: the actor's log-probs of fixed tokens (all ranks: a forward),
        which every server must reproduce after the update (WeightSync.verify)."""
        vocab = self.actor.spec.vocab_size
        tokens = torch.randint(1, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
        lp = self.actor.logprobs({"tokens": tokens, "attention_mask": torch.ones_like(tokens, dtype=torch.bool)})
        return {"check_tokens": tokens[0].tolist(), "check_prompt_len": 1,
                "reference_logprobs": lp[0, 1:].float().cpu().tolist()}

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
        if colo.is_colocated(cfg):
            self._start_colocated()
            if not self.rank0:
                return
        in_buffer = {unit_of(t) for t in self.buffer.restore()} if state else set()
        self.rollout = C.build_rollout_side(cfg, self.model_dir, self.buffer.put, group_size=self.group, state=state,
                                            in_buffer=in_buffer, step_offset=self.step, colocated=self.colocated)
        self.driver = self.rollout  # what the loop reads: error, finished, failed, in_flight, state()
        self.buffer.on_drop = self.rollout.requeue
        self.rollout.start()
        self.formatter = self.rollout.formatter

    # ------------------------------------------------------------------ colocated placement
    # Every rank hosts a vLLM engine shard; generation and training take turns on the GPUs
    # (rollout/colocate/cycle.py has the order and why). These hooks are no-ops otherwise.
    def _models(self) -> list:
        return [m for m in (self.actor, self.critic) if m is not None]

    def _start_colocated(self) -> None:
        """Every rank: trainer offloaded, its engine shard built, then loaded with the actor's weights
        (resumed or not). vLLM re-seeds the global RNG when it builds; the trainer's stream is kept."""
        self.colocated = colo.build_colocated(self.cfg, self.model_dir, self.ctx)
        rng = rng_state()
        self.colocated.start(self.actor, self._models(), bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20,
                             check_tokens=colo.check_tokens(self.cfg, self.actor.spec.vocab_size),
                             atol=self.cfg.rollout.weight_sync_check_atol)
        set_rng_state(rng)

    def _rollout_phase(self):
        """Colocated: every rank serves its engine shard until rank 0 holds the next batch (returned on
        rank 0), the run must stop, or rollout.timeout_s passes. Elsewhere rollouts never stop: None."""
        if self.colocated is None:
            return None
        self._wait_for_rank0("the rollout phase")
        got: dict = {}
        deadline = time.monotonic() + self.cfg.rollout.timeout_s

        def until() -> bool:
            if self.driver.error is not None or self._stop_requested or time.monotonic() > deadline:
                return True
            got["batch"] = self.buffer.take(self.step, self.version, timeout=0)
            return got["batch"] is not None
        try:
            self.colocated.serve(until if self.rank0 else None)
        except RuntimeError as e:
            raise TrainingStopped(f"colocated rollout phase at step {self.step} failed: {e}; resume from the last "
                                  "checkpoint") from e
        return got.get("batch")

    def _before_train(self) -> None:
        if self.colocated is not None:
            self.colocated.before_train(self._models())

    def _after_train(self, train_s: float) -> dict:
        """Colocated: trainer offloaded, the actor's weights loaded into every shard, KV cache back; an
        evaluation when due runs as its own rollout phase. Returns the phase figures (rank 0)."""
        if self.colocated is None:
            return {}
        models = self._models()
        self.colocated.mark_train(train_s, models)
        t0 = time.monotonic()
        update = self.colocated.refresh(self.actor, models, version=self.version,
                                        bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb << 20,
                                        check_tokens=colo.check_tokens(self.cfg, self.actor.spec.vocab_size),
                                        atol=self.cfg.rollout.weight_sync_check_atol)
        m = {"time/weight_sync_s": time.monotonic() - t0,
             **{f"colocate/update_{k}": v for k, v in update.items() if isinstance(v, (int, float))}}
        if self._eval_due(self.step + 1):
            m["eval/accuracy"] = self._evaluate_colocated()
        phases, records = self.colocated.take_records(self.step)
        if self.rank0:
            m.update(phases)
            with open(self.run_dir.path / "colocate_trace.jsonl", "a") as f:
                f.writelines(json.dumps(r, default=str) + "\n" for r in records)
        return m

    def _evaluate_colocated(self) -> float | None:
        """Evaluation episodes need the engines: every rank serves until rank 0's evaluation finished."""
        from megatron_sao.trainer.evaluate import eval_loop_config, summarize

        fut = tasks = None
        if self.rank0:
            tasks = C.eval_tasks(self.cfg)
            fut = self.rollout.driver.submit(self.rollout.evaluation(tasks, C.env_factory(self.cfg),
                                                                     eval_loop_config(self.cfg)))
        self._wait_for_rank0("the evaluation phase")
        self.colocated.serve(fut.done if self.rank0 else None, evaluation=True)
        if not self.rank0:
            return None
        out = self.run_dir.path / "eval" / f"step_{self.step + 1:06d}.jsonl"
        return summarize(tasks, fut.result(), out)["accuracy"]

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return bool(every) and (step % every == 0 or step == self.total)

    def _trainer_on_device(self):
        """Checkpoints and the final export read the trainer state: colocated, the engine sleeps for them."""
        if self.colocated is None or self.actor.resident():
            return contextlib.nullcontext()
        return self.colocated.trainer_resident(self._models())

    def _post_resume_sync(self) -> None:
        """The servers start from the base model: give them the resumed weights (all ranks)."""
        if self.colocated is not None:
            return  # the colocated start already loaded the resumed actor into every shard
        self._push(self.actor.export_hf_weights(self.cfg.rollout.weight_sync_bucket_mb << 20), self.version)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        state = {"step": self.step, "version": self.version, "nonfinite": self.nonfinite,
                 "driver": self.driver.state() if self.rank0 else None,
                 "baseline": self.baseline.state_dict() if self.baseline else None,
                 "buffer_stats": vars(self.buffer.stats) if self.rank0 else None, "rng": rng_state(),
                 # The trajectory files this checkpoint has trained on: resume never loads them
                 # again, whether or not the release below happened before a kill.
                 "covered": self.buffer.covered() if self.rank0 else None}

        def parts(d: Path):
            self.actor.save(str(d / "actor"))
            if self.critic is not None:
                self.critic.save(str(d / "critic"))
        with self._trainer_on_device():
            previous = self.run_dir.save_checkpoint(self.step, parts, state, barrier=self._barrier)
        if self.rank0 and previous is not None:
            # Release only what the older kept checkpoint covers too: a fallback to it (the newest
            # one damaged) must still find the trajectories trained after it.
            self.buffer.release_consumed(ckpts.step_of(previous) - 1)

    def _resume(self) -> dict | None:
        """Load the newest intact checkpoint (falling back past damaged ones, which are named and set
        aside); with none at all, clear what an earlier attempt logged and start fresh."""
        root = self.run_dir.ckpt_root
        found = self._broadcast([str(p) for p in ckpts.candidates(root)] if self.rank0 else None)
        if not found:
            if self.rank0:
                self.run_dir.clear_training()
            logger.warning("--resume: no checkpoint in %s; starting fresh (what an earlier attempt logged "
                           "and buffered is removed: no checkpoint covers it)", root)
            return None
        damaged: list[tuple[Path, str]] = []
        for ckpt in map(Path, found):
            problem = self._checkpoint_damage(ckpt)
            if problem is None:
                break
            logger.warning("checkpoint %s is damaged: %s", ckpt.name, problem)
            damaged.append((ckpt, problem))
        else:
            raise UserError(f"--resume: no intact checkpoint in {root}: "
                            + "; ".join(f"{c.name}: {p}" for c, p in damaged))
        if damaged:
            if self.rank0:
                for bad, _ in damaged:
                    ckpts.set_aside(root, bad, ckpt)
            logger.warning("resuming from %s, the newest intact checkpoint (set aside as *.damaged: %s)",
                           ckpt.name, ", ".join(bad.name for bad, _ in damaged))
            self._barrier()
        state = ckpts.load_trainer_state(ckpt)
        self.actor.load(str(ckpt / "actor"))
        if self.critic is not None:
            self.critic.load(str(ckpt / "critic"))
        self.step, self.version, self.nonfinite = state["step"], state["version"], dict(state["nonfinite"])
        if self.baseline is not None and state.get("baseline"):
            self.baseline.load_state_dict(state["baseline"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        if self.rank0:
            self.buffer.restore({tid: step for tid, step in state.get("covered") or []})
        self.run_dir.truncate_logs(self.step)
        logger.info("resumed from %s at step %d (policy version %d)", ckpt, self.step, self.version)
        return state

    def _checkpoint_damage(self, ckpt: Path) -> str | None:
        """Agreed by all ranks: rank 0 checks the manifest and trainer state, every rank its own shards."""
        r = self.ctx.rank
        mine = [f"{role}/rank_{r:05d}.pt" for role in ("actor", "critic")
                if role == "actor" or self.critic is not None]
        problem = (ckpts.damage(ckpt) if self.rank0 else None) or ckpts.damage(ckpt, rank_files=mine)
        if self.ctx.world_size == 1:
            return problem
        everyone = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, problem)
        return next((p for p in everyone if p), None)

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
            "rollout_idle_fraction": self.driver.engine_idle_fraction(),
        })
        started = [t.info["policy_step"] for t in trajs if "policy_step" in t.info]
        if started:  # trainer steps at which this batch's episodes started (non-stationary envs judge by it)
            m["rollout/policy_step_min"], m["rollout/policy_step_max"] = min(started), max(started)
        if self.rollout is not None:
            m.update(self.rollout.metrics())  # per server: episodes, weight version, health, sync check
        # Colocated runs evaluate in _after_train (the engines need a phase of their own).
        if self._eval_due(self.step) and self.rollout is not None and self.colocated is None:
            te = time.monotonic()
            try:
                m["eval/accuracy"] = self.evaluate()
            except TimeoutError as e:  # abandoned, not fatal: a stuck rollout tier stops the next batch wait
                logger.error("step %d: %s; training goes on", self.step, e)
                m["eval/timed_out"] = 1.0
            m["time/eval_s"] = time.monotonic() - te
        self.run_dir.log_metrics(m, tensorboard=self.cfg.run.tensorboard)
        self.run_dir.log_batch(m["step"], trajs)
        self.console.update(m)

    def evaluate(self) -> float:
        from megatron_sao.trainer.evaluate import run_eval

        return run_eval(self.cfg, self.rollout, out_path=self.run_dir.path / "eval" /
                        f"step_{self.step:06d}.jsonl")["accuracy"]

    # ------------------------------------------------------------------ distributed helpers
    # Every collective here may follow a phase only rank 0 runs (batch wait, eval, weight push,
    # rollout start): the others wait for it at the Rank0Gate, outside the collective, so no
    # process-group timeout is spent on it (docs/architecture.md, "Timeouts").
    def _wait_for_rank0(self, what: str) -> None:
        from megatron_sao.distributed import rank0_gate

        waited = rank0_gate.shared().arrive(what)
        if waited > 60:
            logger.info("rank %d waited %.0fs for rank 0 to reach %s", self.ctx.rank, waited, what)

    def _broadcast(self, obj):
        if self.ctx.world_size == 1:
            return obj
        self._wait_for_rank0("a broadcast")
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.ctx.device)
        return box[0]

    def _barrier(self) -> None:
        if self.ctx.world_size > 1:
            self._wait_for_rank0("a barrier")
            dist.barrier()

    def close(self) -> None:
        if self.driver is not None:
            if self.rollout is not None:
                self.rollout.close()  # every engine's sessions and transfer groups, then the loop
            else:
                self.driver.stop()
            self.driver = None
        if self.colocated is not None:
            self.colocated.close()
            self.colocated = None
        if self.buffer is not None:
            self.buffer.close()
        self.console.close()
        self.run_dir.close()
