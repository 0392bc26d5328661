"""Command-line front ends of the converters: `sao convert hf-to-megatron|megatron-to-hf ...` and the
scripts in tools/ (which only call these)."""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_sao.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_sao.errors import UserError


def hf_to_megatron_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sao convert hf-to-megatron",
                                 description="HF safetensors -> megatron-sao sharded Megatron checkpoint")
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None,
                    help="expert tensor parallel size (default: the trainer's rule: 1 when ep >= tp, else tp)")
    ap.add_argument("--role", choices=("actor", "critic"), default="actor")
    ap.add_argument("--value-head-init", choices=("zero", "normal"), default="zero")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        convert_hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                               role=args.role, value_head_init=args.value_head_init, overwrite=args.overwrite,
                               progress=not args.no_progress)
    except (UserError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def megatron_to_hf_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sao convert megatron-to-hf",
                                 description="megatron-sao sharded Megatron checkpoint (any layout) -> HF safetensors")
    ap.add_argument("--megatron-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--max-shard-gb", type=float, default=5.0)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        convert_megatron_to_hf(args.megatron_dir, args.out_dir, overwrite=args.overwrite,
                               max_shard_bytes=int(args.max_shard_gb * 1024**3), progress=not args.no_progress)
    except (UserError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cli_main(args) -> int:
    """Entry from `sao convert DIRECTION ...` (argparse namespace with .direction and .args)."""
    fn = hf_to_megatron_main if args.direction == "hf-to-megatron" else megatron_to_hf_main
    return fn(list(args.args))
