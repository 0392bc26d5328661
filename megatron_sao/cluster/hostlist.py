"""SLURM hostlist expansion ("node[01-04],gpu7" -> node01..node04, gpu7) without `scontrol`.

The sbatch scripts hand SLURM_JOB_NODELIST to the launch plan unexpanded, so the plan is the same
on every machine whatever its SLURM configuration (dry runs, tests, the nodes). It follows SLURM's
syntax: comma-separated hosts, each with zero or more bracket groups of comma-separated numbers
and ranges; a range keeps the zero padding of its lower bound ("01-10" -> 01, 02, ..., 10).
"""

from __future__ import annotations

import itertools
import re

__all__ = ["HostlistError", "expand_hostlist"]

# Safety valve: a typo such as "n[1-1000000]" should fail loudly, not allocate a million names.
MAX_HOSTS = 65536
_HOST_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")


class HostlistError(ValueError):
    """A malformed SLURM hostlist; the message quotes the offending part."""


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in hostlist {text!r}")
    parts.append("".join(cur))
    return parts


def _expand_range_set(body: str, host: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (padding from the lower bound of each range)."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise HostlistError(f"empty range in {host!r}")
        if "-" in item:
            lo, _, hi = item.partition("-")
            if not (lo.isdigit() and hi.isdigit()):
                raise HostlistError(f"range {item!r} in {host!r} is not numeric")
            if int(hi) < int(lo):
                raise HostlistError(f"range {item!r} in {host!r} goes backwards")
            width = len(lo)
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            if not item.isdigit():
                raise HostlistError(f"index {item!r} in {host!r} is not numeric")
            out.append(item)
        if len(out) > MAX_HOSTS:
            raise HostlistError(f"hostlist {host!r} expands to more than {MAX_HOSTS} hosts")
    return out


def _expand_one(host: str) -> list[str]:
    """One top-level entry, possibly with several bracket groups ("r[1-2]n[1-2]")."""
    pieces: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", host):
        if m.start() > pos:
            pieces.append([host[pos:m.start()]])
        pieces.append(_expand_range_set(m.group(1), host))
        pos = m.end()
    if pos < len(host):
        pieces.append([host[pos:]])
    names = ["".join(p) for p in itertools.product(*pieces)]
    for name in names:
        if not _HOST_CHARS.match(name):
            raise HostlistError(f"invalid host name {name!r} (from {host!r})")
    return names


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM hostlist into host names, in order, duplicates removed (first one kept).

    >>> expand_hostlist("node[01-03],gpu7")
    ['node01', 'node02', 'node03', 'gpu7']
    """
    if not isinstance(text, str) or not text.strip():
        raise HostlistError("empty hostlist (is SLURM_JOB_NODELIST set?)")
    hosts: list[str] = []
    seen: set[str] = set()
    for entry in _split_top_level(text.strip()):
        entry = entry.strip()
        if not entry:
            raise HostlistError(f"empty entry in hostlist {text!r}")
        for name in _expand_one(entry):
            if name not in seen:
                seen.add(name)
                hosts.append(name)
            if len(hosts) > MAX_HOSTS:
                raise HostlistError(f"hostlist expands to more than {MAX_HOSTS} hosts")
    return hosts
