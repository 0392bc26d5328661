"""A run's CPU seconds: its process and the processes it waited for (a wall time on a shared machine
says little without them), and its exit status as Popen would give it."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.reproduce import runner

# A child that burns about 0.6 CPU s in a grandchild it waits for, then exits 3.
BURN = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
        "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass']); sys.exit(3)")


def test_cpu_seconds_count_the_waited_for_grandchild_and_the_exit_status_is_kept(monkeypatch):
    monkeypatch.setattr(runner, "LOAD_SAMPLE_S", 0.2)
    samples = []
    p = subprocess.Popen([sys.executable, "-c", BURN])
    cpu = runner._wait_cpu_seconds(p, lambda: samples.append(1))
    assert p.returncode == 3 and p.poll() == 3
    assert cpu >= 0.6, cpu  # the grandchild's 0.6 s, which the child's own CPU time alone would miss
    assert samples  # the load was sampled while it ran (well over 0.2 s)
