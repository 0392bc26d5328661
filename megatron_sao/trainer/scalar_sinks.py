"""Where a step's scalars go besides metrics.jsonl: TensorBoard and Weights & Biases, one fan-out.

`ScalarSinks.write(record, step)` flattens the step's record once ("actor/loss", "lag_histogram/1", ...),
keeps the finite numbers, and hands the same dict to every sink, so TensorBoard and W&B always show
the same scalars. Each sink opens lazily on its first write (rank 0 only: RunDir is the writer).

Resume: TensorBoard's writer opens with `purge_step` (the events of steps after the checkpoint are
dropped). W&B keeps one run per run directory (its id in `<run>/wandb/run_id`, resumed with
resume="allow"); W&B cannot drop logged steps, and it ignores a step it already holds, so the steps
logged after the checkpoint and before a crash keep their first values there.
"""

from __future__ import annotations

import logging
import math
import uuid
from pathlib import Path
from typing import Any, Protocol

from megatron_sao.config import WandbConfig
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
    """One W&B run per run directory: `run.wandb` (project, entity, mode), named after `run.name`,
    with the resolved config; files under `<run>/wandb/`."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, name: str, config: dict[str, Any]):
        self.cfg, self.run_dir, self.name, self.config = cfg, run_dir, name, config
        self._run = None

    def _run_id(self) -> str:
        f = self.run_dir / "wandb" / "run_id"
        if f.is_file():
            return f.read_text().strip()
        f.parent.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:12]
        f.write_text(run_id + "\n")
        return run_id

    def write(self, scalars: dict[str, float], step: int) -> None:
        if self._run is None:
            import wandb

            self._run = wandb.init(project=self.cfg.project, entity=self.cfg.entity, mode=self.cfg.mode,
                                   name=self.name, id=self._run_id(), resume="allow", dir=str(self.run_dir),
                                   config=self.config)
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
