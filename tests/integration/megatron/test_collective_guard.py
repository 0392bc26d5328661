"""The collective-device rule on CPU: collective_guard fails what NCCL would refuse on a GPU job.

The guard is on for the whole suite (tests/conftest.py sets SAO_COLLECTIVE_GUARD=1, inherited by
every engine worker and `sao` subprocess); this file checks its verdicts and that the project's
known call sites pass it. Runs in a subprocess: the guard patches torch.distributed process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.collective_guard_probe"

REFUSED = ["host_factory", "explicit_cpu", "source_stays_on_host", "derived_from_host", "stacked_host",
           "moved_back_to_host", "to_cpu_string", "all_gather_list", "object_without_device", "default_group_object",
           "monitored_barrier_on_nccl_group"]
ACCEPTED = ["named_device", "moved", "follows_device_of", "object_with_device", "gloo_group_takes_host",
            "caller_outside_the_package"]
PROJECT_SITES = ["freeze_check", "loop_stop_agreed", "loop_broadcast"]


@pytest.fixture(scope="module")
def verdicts():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", WORKER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT guard "))
    return json.loads(line[len("RESULT guard "):])


@pytest.mark.slow
def test_the_suite_runs_with_the_guard():
    assert os.environ.get("SAO_COLLECTIVE_GUARD") == "1"


@pytest.mark.slow
def test_ctx_device_is_the_pretend_accelerator(verdicts):
    assert verdicts["_facts"] == {"ctx_device": "cpu:0", "collective_device": "cpu:0", "installed": True}


@pytest.mark.slow
@pytest.mark.parametrize("case", REFUSED)
def test_refused(verdicts, case):
    assert verdicts[case].startswith("CollectiveDeviceError: dist."), verdicts[case]
    assert "megatron_sao/_guard_probe.py:" in verdicts[case]  # names the call site


@pytest.mark.slow
@pytest.mark.parametrize("case", ACCEPTED)
def test_accepted(verdicts, case):
    assert verdicts[case] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("site", PROJECT_SITES)
def test_project_call_sites_put_their_tensors_on_the_device(verdicts, site):
    """freeze.check_patterns_matched_globally (critic build) and the trainer's stop agreement and
    broadcast; the engine's train step and grad-norm groups run in the engine workers."""
    assert verdicts[site] == "ok"
