#!/usr/bin/env python
"""Convert an HF safetensors checkpoint into a megatron-sao sharded Megatron checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir D --out-dir M [--tp N --pp N --ep N --etp N]
        [--role actor|critic] [--value-head-init normal|zero] [--overwrite]

Thin wrapper of megatron_sao.checkpoint.convert.convert_hf_to_megatron (also `sao convert hf-to-megatron`).
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sao.checkpoint.convert import convert_hf_to_megatron  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: = tp)")
    ap.add_argument("--role", choices=("actor", "critic"), default="actor")
    ap.add_argument("--value-head-init", choices=("normal", "zero"), default="normal")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        convert_hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                               role=args.role, value_head_init=args.value_head_init, overwrite=args.overwrite,
                               progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
