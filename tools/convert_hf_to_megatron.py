#!/usr/bin/env python
"""Convert an HF safetensors checkpoint into a megatron-sao sharded Megatron checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir D --out-dir M [--tp N --pp N --ep N --etp N]
        [--role actor|critic] [--value-head-init normal|zero] [--overwrite]

Same as `sao convert hf-to-megatron ...` (megatron_sao/checkpoint/convert_cli.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sao.checkpoint.convert_cli import hf_to_megatron_main

if __name__ == "__main__":
    sys.exit(hf_to_megatron_main())
