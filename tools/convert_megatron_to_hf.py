#!/usr/bin/env python
"""Convert a megatron-sao sharded Megatron checkpoint (any TP/PP/EP) back to an HF safetensors dir.

    python tools/convert_megatron_to_hf.py --megatron-dir M --out-dir H [--max-shard-gb 5] [--overwrite]

Same as `sao convert megatron-to-hf ...` (megatron_sao/checkpoint/convert_cli.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sao.checkpoint.convert_cli import megatron_to_hf_main

if __name__ == "__main__":
    sys.exit(megatron_to_hf_main())
