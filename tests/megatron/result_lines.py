"""Reading the `RESULT <tag> <json>` lines that multi-rank workers print.

Not line by line: every rank shares torchrun's stdout, so a rank's line can arrive glued to another
rank's output ("...warningRESULT pp2 {...}" or "RESULT a {...}RESULT b {...}"). A line-start parser
then drops a result silently and a test fails on a missing key, as tests here did now and then in CI
and under load.
"""

from __future__ import annotations

import json
import re


def parse_tagged(out: str) -> dict[str, object]:
    """Every `RESULT <tag> <json>` anywhere in ``out``, by tag (a later one with the same tag wins)."""
    dec = json.JSONDecoder()
    return {m.group(1): dec.raw_decode(out, m.end())[0] for m in re.finditer(r"RESULT (\S+) (?=[\[{\"\d-])", out)}


def parse_untagged(out: str) -> list:
    """Every `RESULT <json>` (no tag) anywhere in ``out``, in order."""
    dec = json.JSONDecoder()
    return [dec.raw_decode(out, m.end())[0] for m in re.finditer(r"RESULT (?=[\[{])", out)]
