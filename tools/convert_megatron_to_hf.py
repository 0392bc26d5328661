#!/usr/bin/env python
"""Convert a megatron-sao sharded Megatron checkpoint (any TP/PP/EP) back to an HF safetensors dir.

    python tools/convert_megatron_to_hf.py --megatron-dir M --out-dir H [--max-shard-gb 5] [--overwrite]

Thin wrapper of megatron_sao.checkpoint.convert.convert_megatron_to_hf (also `sao convert megatron-to-hf`).
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sao.checkpoint.convert import convert_megatron_to_hf  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
