"""Bad input through the real `sao` CLI: one line naming the problem, exit 2, no traceback, nothing written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_sao.trajectory import TrajectoryBuilder, save_trajectories
from tests.paths import REPO

pytestmark = pytest.mark.slow
CONFIG = str(REPO / "tests" / "e2e" / "tiny_ci.yaml")


def sao(*args, cwd=None):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_sao.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def _traj():
    b = TrajectoryBuilder(prompt_id="p", env="toy_tool")
    b.add_prompt([5, 6, 7])
    b.add_action([10, 11], [-0.5, -0.25], 0)
    return b.finish("terminated", reward=1.0)


def _replay(path, **edit):
    save_trajectories(path, [_traj() for _ in range(40)])
    if edit:
        with safe_open(str(path), "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        save_file({**tensors, **{k: fn(tensors) for k, fn in edit.items()}}, str(path), metadata=meta)
    return path


def _truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A real HF checkpoint of the built-in CI model, its weights file cut short."""
    from megatron_sao.models.builtin import materialize_builtin_model

    d = materialize_builtin_model("tiny_qwen3_moe_ci", tmp_path_factory.mktemp("hf") / "model", seed=0)
    _truncated(d / "model.safetensors")
    return d


def _run_with_damaged_checkpoint(tmp: Path) -> Path:
    """A run directory as a crashed run leaves it: its config, logs, base model, buffer (with a
    stray file in it) and a committed checkpoint that is damaged (no manifest), the only one."""
    from megatron_sao.models.builtin import materialize_builtin_model

    run = tmp / "damaged"
    materialize_builtin_model("tiny_qwen3_moe_ci", run / "base_model", seed=3)
    (run / "config.yaml").write_text("# the run's own record, written when it started\nrun: {total_steps: 2}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (run / "buffer" / "failed").mkdir(parents=True)
    (run / "buffer" / "notes.safetensors").write_text("my notes")
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000001")
    return run


def _resumable_run(tmp: Path) -> Path:
    """A run folder a resume would continue: tiny_ci's config.yaml and a committed checkpoint."""
    import torch

    from megatron_sao.config import load_config
    from megatron_sao.trainer import checkpoints as ckpts
    from megatron_sao.trainer.run_dir import RunDir

    run = tmp / "resumable"
    RunDir(run).write_config(load_config(CONFIG, [f"run.dir={run}"]), keep_previous=False)

    def parts(d):  # an engine directory of the per-rank format: one torch file per rank and meta.json
        (d / "actor").mkdir()
        torch.save({"w": torch.zeros(4)}, d / "actor" / "rank_00000.pt")
        (d / "actor" / "meta.json").write_text("{}")
    ckpts.save(run / "checkpoints", 1, parts, {"step": 1}, is_writer=True)
    return run


def _cases(tmp: Path, hf: Path):
    run = tmp / "run"
    occupied = tmp / "occupied"
    occupied.mkdir()
    (occupied / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (tmp / "config.bin").write_bytes(bytes(range(256)) * 8)
    (tmp / "a_directory").mkdir()
    (tmp / "empty.yaml").write_text("# nothing set: every default would train\n")
    damaged = _run_with_damaged_checkpoint(tmp)
    resumable = _resumable_run(tmp)
    return {
        "unknown environment": (["train", CONFIG, f"run.dir={run}", "env.name=nope_env"],
                                "env.name: unknown environment 'nope_env'; available: ", run),
        "binary config": (["train", str(tmp / "config.bin"), f"run.dir={run}"],
                          "config.bin: not a YAML text file (byte 128 is not UTF-8)", run),
        "directory as config": (["train", str(tmp / "a_directory"), f"run.dir={run}"],
                                "a_directory is a directory, not a YAML file", run),
        "failed resume": (["train", CONFIG, f"run.dir={damaged}", "run.total_steps=5", "--resume"],
                          "--resume: no intact checkpoint in", damaged),
        "misspelled key": (["train", CONFIG, f"run.dir={run}", "run.totl_steps=3"], "run.totl_steps", run),
        "wrong type": (["train", CONFIG, f"run.dir={run}", "run.total_steps=abc"], "run.total_steps", run),
        "negative batch size": (["train", CONFIG, f"run.dir={run}", "buffer.batch_size=-1"], "buffer.batch_size", run),
        "missing config": (["train", str(tmp / "nope.yaml"), f"run.dir={run}"], "nope.yaml does not exist", run),
        "missing model": (["train", CONFIG, f"run.dir={run}", "model.path=/nonexistent/model"], "model.path", run),
        "replay length mismatch": (
            ["train", CONFIG, f"run.dir={run}",
             f"trainer.replay={_replay(tmp / 'len.safetensors', versions=lambda t: t['versions'][:-3])}"],
            "len.safetensors: length mismatch", run),
        "replay offsets past the end": (
            ["train", CONFIG, f"run.dir={run}",
             "trainer.replay="
             f"{_replay(tmp / 'off.safetensors', offsets=lambda t: t['offsets'] + (t['offsets'] > 0) * 7)}"],
            "off.safetensors: offsets run from 0 to", run),
        "replay truncated": (["train", CONFIG, f"run.dir={run}",
                              f"trainer.replay={_truncated(_replay(tmp / 'cut.safetensors'))}"],
                             "cut.safetensors: truncated: tensor", run),
        "replay too short": (["train", CONFIG, f"run.dir={run}", "run.total_steps=20",
                              f"trainer.replay={_replay(tmp / 'short.safetensors')}"], "holds 40 trainable", run),
        "run directory in use": (["train", CONFIG, f"run.dir={occupied}"], "already holds a training run", occupied),
        "run.dir is a file": (["train", CONFIG, f"run.dir={tmp / 'config.bin'}"], "exists and is not a directory",
                              tmp / "config.bin"),
        "sft run.dir below a file": (["sft", CONFIG, f"run.dir={tmp / 'config.bin' / 'run'}"],
                                     "config.bin is not a directory", tmp / "config.bin"),
        "empty config": (["train", str(tmp / "empty.yaml"), f"run.dir={run}"], "the config is empty", run),
        "resume with another model": (
            ["train", CONFIG, f"run.dir={resumable}", "model.path=tiny_qwen3_moe", "--resume"],
            "model.path: 'tiny_qwen3_moe_ci' -> 'tiny_qwen3_moe'", resumable),
        "sft config error": (["sft", CONFIG, f"run.dir={run}", "sft.steps=many"], "sft.steps", run),
        "convert truncated safetensors": (
            ["convert", "hf-to-megatron", "--hf-dir", str(hf), "--out-dir", str(tmp / "mc"), "--no-progress"],
            "model.safetensors: truncated: tensor '", tmp / "mc"),
    }


def _snapshot(d: Path) -> dict[str, bytes] | None:
    """Every file and directory below `d` with its content: what "nothing written" compares."""
    if not d.exists():
        return None
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(d.rglob("*"))}


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, hf_dir):
    for name, (args, needle, written) in _cases(tmp_path, hf_dir).items():
        before = _snapshot(written)
        p = sao(*args)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2, f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr and len(lines) == 1, f"{name}:\n{p.stderr[-3000:]}"
        assert needle in lines[0], f"{name}: {lines[0]!r}"
        after = _snapshot(written)
        before_, after_ = before or {}, after or {}
        changed = sorted(k for k in set(before_) | set(after_) if before_.get(k) != after_.get(k))
        assert after == before, f"{name}: {written} changed: {changed}"


def test_files_in_buffer_that_do_not_parse_are_set_aside_on_resume(tmp_path, caplog):
    """A stray file (not <seq>-<id>.safetensors) and a damaged trajectory file: resume names each,
    moves it to buffer/set_aside/ and restores the rest (before: every --resume failed on int())."""
    from megatron_sao.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(batch_size=2, max_staleness=4, directory=tmp_path / "buffer")
    for _ in range(3):
        buf.put(_traj())
    buf.close()
    good = sorted((tmp_path / "buffer").glob("*.safetensors"))
    (tmp_path / "buffer" / "notes.safetensors").write_text("my notes")
    _truncated(good[1])
    (tmp_path / "buffer" / "failed" / "x.safetensors").write_text("")
    with caplog.at_level("WARNING", logger="megatron_sao.buffer"):
        restored = TrajectoryBuffer(batch_size=2, max_staleness=4, directory=tmp_path / "buffer").restore()
    assert len(restored) == 2  # the two intact files
    aside = tmp_path / "buffer" / "set_aside"
    assert sorted(p.name for p in aside.iterdir()) == sorted(["notes.safetensors", good[1].name])
    assert (aside / "notes.safetensors").read_text() == "my notes"  # moved, never deleted
    assert (tmp_path / "buffer" / "failed" / "set_aside" / "x.safetensors").exists()
    text = caplog.text
    assert "notes.safetensors is not a trajectory file of this buffer" in text
    assert f"{good[1].name} cannot be read" in text


def _garbage_weights(d: Path) -> Path:
    """`model.safetensors` with a valid header and seeded random bytes for its data (the right size)."""
    import random
    import struct

    data = bytearray((d / "model.safetensors").read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = random.Random(0).randbytes(len(data) - start)
    (d / "model.safetensors").write_bytes(bytes(data))
    return d


def test_garbage_weights_are_refused_naming_the_file_before_any_checkpoint(tmp_path):
    """Random bytes of the right size load as weights with NaN/inf among them: refused when read, naming
    the file and the tensor (it trained, wrote a checkpoint of them, and stopped on rollout log-probs)."""
    from megatron_sao.models.builtin import materialize_builtin_model

    model = _garbage_weights(materialize_builtin_model("tiny_qwen3_moe_ci", tmp_path / "model", seed=0))
    run = tmp_path / "run"
    p = sao("train", CONFIG, f"run.dir={run}", f"model.path={model}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert "model.safetensors: tensor" in last and "non-finite value(s)" in last, last
    assert not list((run / "checkpoints").glob("step_*")) and not (run / "final_model").exists()
