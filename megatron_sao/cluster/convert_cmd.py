"""The checkpoint-conversion command for a recipe: its TP/PP/EP read from the same YAML as training.

    python -m megatron_sao.cluster.convert_cmd --config C hf-to-megatron --hf-dir H --megatron-dir M
    python -m megatron_sao.cluster.convert_cmd --config C megatron-to-hf --megatron-dir M --out-dir H

prints the `tools/convert_*.py` command line (slurm/convert.sh runs it), so a converted checkpoint
always has the layout the trainer will load (a mismatch is otherwise found only at load time).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from megatron_sao.config import ConfigError, load_config


def convert_argv(config: str, direction: str, *, hf_dir: str | None = None, megatron_dir: str | None = None,
                 out_dir: str | None = None, overrides: Sequence[str] = (), python: str = "python") -> list[str]:
    """argv of the converter for `direction` ("hf-to-megatron" | "megatron-to-hf")."""
    from megatron_sao.models.parallel_sizes import ParallelSizes

    cfg = load_config(config, overrides)
    p = ParallelSizes.from_config(cfg.parallel)  # etp: parallel.etp or the trainer's default rule
    if direction == "hf-to-megatron":
        if not hf_dir or not megatron_dir:
            raise ValueError("hf-to-megatron needs --hf-dir and --megatron-dir")
        return [python, "tools/convert_hf_to_megatron.py", "--hf-dir", hf_dir, "--out-dir", megatron_dir,
                "--tp", str(p.tp), "--pp", str(p.pp), "--ep", str(p.ep), "--etp", str(p.expert_tp)]
    if direction == "megatron-to-hf":
        if not megatron_dir or not out_dir:
            raise ValueError("megatron-to-hf needs --megatron-dir and --out-dir")
        # The Megatron checkpoint records its own layout; the reader gathers TP/PP/EP shards.
        return [python, "tools/convert_megatron_to_hf.py", "--megatron-dir", megatron_dir, "--out-dir", out_dir]
    raise ValueError(f"direction must be hf-to-megatron or megatron-to-hf, got {direction!r}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_sao.cluster.convert_cmd",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("direction", choices=("hf-to-megatron", "megatron-to-hf"))
    ap.add_argument("--hf-dir")
    ap.add_argument("--megatron-dir")
    ap.add_argument("--out-dir")
    ap.add_argument("--python", default="python")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # overrides may follow options
    try:
        argv_out = convert_argv(args.config, args.direction, hf_dir=args.hf_dir, megatron_dir=args.megatron_dir,
                                out_dir=args.out_dir, overrides=args.overrides, python=args.python)
    except (ValueError, ConfigError) as e:
        print(f"convert_cmd: error: {e}", file=sys.stderr)
        return 2
    print(shlex.join(argv_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
