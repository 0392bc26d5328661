"""Where a step's scalars go besides metrics.jsonl: TensorBoard and Weights & Biases, one fan-out.

`ScalarSinks.write(record, step)` flattens the step's record once ("actor/loss", "lag_histogram/1", ...),
keeps the finite numbers, and hands the same dict to every sink, so TensorBoard and W&B always show
the same scalars. Each sink opens lazily on its first write (rank 0 only: RunDir is the writer).

Every stage logs through it: `sao train` (RunDir.configure_scalars: `<run>/tensorboard`, `<run>/wandb`)
and the stages before RL (`stage_sinks`: `sao sft` under `<run>/sft/`, `sao value-pretrain` under
`<run>/value_pretrain/`). Each stage is its own W&B run, named `<run.name>-<stage>` except the RL run
(`<run.name>`), with job_type the stage and group `run.name`, so one experiment's stages sit together.

Resume: TensorBoard's writer opens with `purge_step` (the events of steps after the checkpoint are
dropped). W&B keeps one run per run directory (its id in `<run>/wandb/run_id`, resumed with
resume="allow"); W&B cannot drop logged steps, and it ignores a step it already holds, so the steps
logged after the checkpoint and before a crash keep their first values there. The stages before RL
do not resume: each invocation starts over, its TensorBoard directory emptied as its metrics are,
and is a new W&B run (an earlier one's files stay: an offline run may not be synced yet).
"""

from __future__ import annotations

import logging
import math
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

from megatron_sao.config import RunConfig, WandbConfig
from megatron_sao.errors import UserError

logger = logging.getLogger(__name__)


class ScalarSink(Protocol):
    def write(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def flat_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a (nested) record under "/"-joined keys; bools, strings, lists dropped."""
    out: dict[str, float] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + "/")
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[key] = v
    walk(record, "")
    return out


class TensorBoardSink:
    def __init__(self, directory: Path):
        self.directory = directory
        self.purge_step: int | None = None  # set on resume, before the first write
        self._writer = None

    def write(self, scalars: dict[str, float], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.directory), purge_step=self.purge_step)
        for k, v in scalars.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def require_wandb() -> None:
    """Before training starts: a configured W&B that cannot import is the user's to fix, said now."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise UserError(f"run.wandb.project is set but the wandb package does not import ({e}); "
                        "pip install wandb, or leave run.wandb.project unset") from e


class WandbSink:
    """One W&B run of one stage: `run.wandb` (project, entity, mode), the resolved config, files under
    `<directory>/wandb/`. `resume`: one run per directory across invocations (`sao train`), else a new
    run each time."""

    def __init__(self, cfg: WandbConfig, directory: Path, name: str, config: dict[str, Any], *, group: str,
                 job_type: str, resume: bool = True):
        self.cfg, self.directory, self.name, self.config = cfg, directory, name, config
        self.group, self.job_type, self.resume = group, job_type, resume
        self._run = None

    def _run_id(self) -> str:
        if not self.resume:
            return uuid.uuid4().hex[:12]
        f = self.directory / "wandb" / "run_id"
        if f.is_file():
            return f.read_text().strip()
        f.parent.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:12]
        f.write_text(run_id + "\n")
        return run_id

    def write(self, scalars: dict[str, float], step: int) -> None:
        if self._run is None:
            import wandb

            (self.directory / "wandb").mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(project=self.cfg.project, entity=self.cfg.entity, mode=self.cfg.mode,
                                   name=self.name, id=self._run_id(), resume="allow" if self.resume else None,
                                   dir=str(self.directory), config=self.config, group=self.group,
                                   job_type=self.job_type)
        self._run.log(scalars, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class ScalarSinks:
    """The fan-out: every sink gets the same flat scalars of a step."""

    def __init__(self, sinks: list[ScalarSink] | None = None):
        self.sinks: list[ScalarSink] = list(sinks or [])

    def add(self, sink: ScalarSink) -> None:
        self.sinks.append(sink)

    def write(self, record: dict[str, Any], step: int) -> None:
        if not self.sinks:
            return
        scalars = flat_scalars(record)
        for sink in self.sinks:
            sink.write(scalars, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def stage_sinks(run: RunConfig, stage: str, directory: Path, config: dict[str, Any], is_writer: bool) -> ScalarSinks:
    """The sinks of a stage before RL (`sao sft`, `sao value-pretrain`) writing under `directory`:
    TensorBoard (`run.tensorboard`) and W&B (`run.wandb`), on the writing rank only (module docstring)."""
    sinks = ScalarSinks()
    if not is_writer:
        return sinks
    if run.tensorboard:
        shutil.rmtree(directory / "tensorboard", ignore_errors=True)
        sinks.add(TensorBoardSink(directory / "tensorboard"))
    if run.wandb.project is not None:
        require_wandb()
        sinks.add(WandbSink(run.wandb, directory, f"{run.name}-{stage}", config, group=run.name, job_type=stage,
                            resume=False))
    return sinks
