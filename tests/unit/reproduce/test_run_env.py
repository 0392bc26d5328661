"""A run's environment (runner.PORTABLE_NUMERICS for the shared starting points): the stage process gets
it, the run's key changes with it (other bits, another run), and the runs without one keep their keys
(the result files committed so far are found by them). The stage is a stand-in script at the subprocess
boundary."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from benchmarks.reproduce import runner
from benchmarks.reproduce.runner import PORTABLE_NUMERICS, Run
from megatron_sao.config.strict_yaml import load_strict

STAGE = """
import json, os, sys
from pathlib import Path
d = Path(next(a for a in sys.argv if a.startswith("run.dir=")).split("=", 1)[1])
(d / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR",
                                                                        "OMP_NUM_THREADS")}))
(d / "sft_model").mkdir()
(d / "sft_model" / "config.json").write_text("{}")
"""


def test_a_run_without_an_environment_keeps_the_key_it_always_had():
    run = Run("smollm2_sft", 1, "examples/smollm2_arith.yaml", ("sft.eval=false",), stage="sft")
    content = load_strict((runner.ROOT / run.config).read_text())
    before = hashlib.sha256(json.dumps(["sft", content, ["sft.eval=false"], 1, runner.algorithm_version()],
                                       sort_keys=True, default=str).encode()).hexdigest()[:10]
    assert run.key() == before
    portable = Run("smollm2_sft", 1, "examples/smollm2_arith.yaml", ("sft.eval=false",), stage="sft",
                   env=PORTABLE_NUMERICS)
    assert portable.key() != before


def test_the_stage_process_runs_with_the_run_s_environment_and_its_record_names_it(tmp_path, monkeypatch):
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    monkeypatch.setattr(runner, "stage_command", lambda run, d, resume: [sys.executable, str(script), f"run.dir={d}"])
    monkeypatch.setenv("MKL_CBWR", "AUTO")  # the caller's own setting is overridden, not kept
    d = tmp_path / "start"
    res = runner.execute(Run("s", 1, "examples/tiny_cpu.yaml", stage="sft", run_dir=str(d), env=PORTABLE_NUMERICS),
                         tmp_path / "work", threads=2, log=lambda _: None)
    assert res.ok
    seen = json.loads((d / "env.json").read_text())
    assert seen == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "2"}
    info = json.loads(next(Path(d).glob("reproduce_*.json")).read_text())
    assert info["env"] == dict(PORTABLE_NUMERICS) and info["threads"] == 2
