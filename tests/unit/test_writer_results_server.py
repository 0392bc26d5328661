"""The checkpoint writers' queue server is forked before the trainer grows (megatron/writer_results.py).

A forked process keeps the pages its parent had at the fork; the server lives as long as the trainer, so
everything the trainer held when it was forked, and later overwrites, ends up counted twice. Each case runs
in a fresh interpreter: a 512 MiB tensor stands in for the models, and the server's resident memory is read
from /proc once the trainer has filled it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys, torch
from megatron_sao.megatron import writer_results

def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

early = sys.argv[1] == "early"
if early:
    writer_results.start_server()  # what the trainer does before it builds its models
models = torch.empty(128 << 20, dtype=torch.float32).fill_(1.0)  # 512 MiB, resident
writer_results.install_new_queue()  # the first save: starts the server if it is not running
pid = writer_results.start_server()  # the same server: its pid
models.fill_(2.0)  # the steps after the save overwrite the weights
print(json.dumps({"server_mib": rss_mib(pid), "trainer_mib": rss_mib("self")}))
"""


def _server_memory(order: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_server_forked_before_the_models_holds_none_of_them():
    early = _server_memory("early")
    assert early["trainer_mib"] > 512, early
    assert early["server_mib"] < 256, early  # an interpreter with torch imported, no model pages
    # The same script forking the server at the first save, as before: it maps the whole 512 MiB.
    late = _server_memory("late")
    assert late["server_mib"] > 512, late


STOP = """
import os, signal, sys, time
from megatron_sao.cli import exit_on_sigterm
from megatron_sao.megatron import writer_results

exit_on_sigterm()  # sao train's handler until its models are built, when the server is forked
pid = writer_results.start_server()
os.kill(pid, signal.SIGTERM)  # scancel: every process of the job gets one
time.sleep(1.0)
writer_results.install_new_queue()  # the stop's checkpoint: a queue from the same server
assert writer_results.start_server() == pid
print("served")
"""


def test_the_server_outlives_a_sigterm_to_the_whole_job_so_the_stop_checkpoint_can_be_written():
    out = subprocess.run([sys.executable, "-c", STOP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("served"), out.stderr[-2000:]
