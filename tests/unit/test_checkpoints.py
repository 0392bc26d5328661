"""Checkpoint commit, retention, verification and fallback; the run directory's refusal and cleanup."""

import json
import zipfile

import pytest
import torch

from megatron_sao.errors import UserError
from megatron_sao.trainer import checkpoints as C
from megatron_sao.trainer.run_dir import RunDir, check_run_dir, check_train_dir


def _parts(d):
    (d / "actor").mkdir()
    torch.save({"w": torch.arange(1000.0)}, d / "actor" / "rank_00000.pt")


def save(root, step):
    return C.save(root, step, _parts, {"step": step, "rng": {"x": 1}}, is_writer=True)


def test_commit_keeps_two_and_resume_candidates_skip_uncommitted(tmp_path):
    assert save(tmp_path, 1) is None
    assert save(tmp_path, 2) == tmp_path / "step_000001"
    prev = save(tmp_path, 3)
    assert prev == tmp_path / "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]
    manifest = json.loads((tmp_path / "step_000003" / C.MANIFEST).read_text())["files"]
    assert set(manifest) == {"actor/rank_00000.pt", "rng.pt", "trainer_state.json"}
    # A kill between the rename and the rewrite of `latest`: step 4 exists but was never committed.
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000005.tmp").mkdir()
    assert C.candidates(tmp_path) == [tmp_path / "step_000003", tmp_path / "step_000002"]
    assert {p.name for p in C.remove_uncommitted(tmp_path)} == {"step_000004", "step_000005.tmp"}
    # Saving the step a resumed run started from keeps the older one as the fallback.
    assert save(tmp_path, 3) == tmp_path / "step_000002"


def test_damage_names_the_file(tmp_path):
    save(tmp_path, 1)
    ck = tmp_path / "step_000001"
    assert C.damage(ck) is None and C.damage(ck, ["actor/rank_00000.pt"]) is None
    shard = ck / "actor" / "rank_00000.pt"
    data = bytearray(shard.read_bytes())
    with zipfile.ZipFile(shard) as z:  # flip bytes inside the tensor data: same size, bad CRC
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    data[info.header_offset + 200] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert C.damage(ck) is None  # sizes still match the manifest
    assert str(shard) in C.damage(ck, ["actor/rank_00000.pt"]) and "CRC" in C.damage(ck, ["actor/rank_00000.pt"])
    shard.write_bytes(bytes(data[:100]))
    assert f"{shard} has 100 bytes" in C.damage(ck)
    (ck / "trainer_state.json").write_text('{"step": ')
    (ck / C.MANIFEST).unlink()
    assert "trainer_state.json is unreadable" in C.damage(ck)


def test_set_aside_keeps_the_damaged_checkpoint_and_moves_latest(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    aside = C.set_aside(tmp_path, tmp_path / "step_000002", tmp_path / "step_000001")
    assert aside.name == "step_000002.damaged" and aside.is_dir()
    assert C.candidates(tmp_path) == [tmp_path / "step_000001"]
    assert aside not in C.remove_uncommitted(tmp_path)


def test_existing_training_run_is_refused_without_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    check_train_dir(run, resume=False, overwrite=False)  # nothing there
    (run / "sft_model").mkdir(parents=True)
    (run / "checkpoints").mkdir()  # earlier stages create an empty one
    check_train_dir(run, resume=False, overwrite=False)  # earlier stages' outputs are inputs, not a run
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(UserError, match="already holds a training run .*metrics.jsonl.*--resume.*--overwrite"):
        check_train_dir(run, resume=False, overwrite=False)
    check_train_dir(run, resume=True, overwrite=False)
    with pytest.raises(UserError, match="exclude each other"):
        check_train_dir(run, resume=True, overwrite=True)


def test_clear_and_truncate_keep_only_what_a_checkpoint_covers(tmp_path):
    rd = RunDir(tmp_path)
    (tmp_path / "sft_model").mkdir()
    (tmp_path / "eval").mkdir()
    for k in (1, 2, 3):
        (tmp_path / "eval" / f"step_{k:06d}.jsonl").write_text("{}")
    (tmp_path / "eval" / "sft_model.jsonl").write_text("{}")
    lines = "".join(json.dumps({"step": s}) + "\n" for s in range(3)) + '{"step": 3, "los'  # a kill mid-write
    (tmp_path / "metrics.jsonl").write_text(lines)
    rd.truncate_logs(2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["sft_model.jsonl", "step_000001.jsonl",
                                                                     "step_000002.jsonl"]
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "000000001-ab.safetensors").write_bytes(b"x")
    (tmp_path / "buffer" / "000000002-cd.safetensors.tmp-9-zz").write_bytes(b"x")
    assert [p.name for p in rd.remove_stale()] == ["000000002-cd.safetensors.tmp-9-zz"]
    rd.clear_training()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer", "checkpoints", "eval", "sft_model"]
    assert list((tmp_path / "buffer").rglob("*.safetensors")) == []


def test_a_killed_final_export_is_removed_on_the_next_start(tmp_path):
    """atomic_output_dir's temp folder of the end-of-run HF export, left by a kill mid-write, goes; a
    base model another process may be materializing right now stays."""
    rd = RunDir(tmp_path)
    stale = tmp_path / ".final_model.tmp-4242-0a1b2c3d"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    other = tmp_path / ".base_model.tmp-77"
    other.mkdir()
    assert rd.remove_stale() == [stale]
    assert not stale.exists() and other.is_dir()


def test_a_run_dir_that_cannot_be_a_directory_is_refused_naming_it(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError, match="run.dir: .*a_file exists and is not a directory"):
        check_run_dir(tmp_path / "a_file")
    with pytest.raises(UserError, match="run.dir: .*a_file/deeper/run cannot be created: .*a_file is not a directory"):
        check_run_dir(tmp_path / "a_file" / "deeper" / "run")
    check_run_dir(tmp_path / "new" / "run")  # to be created below a directory: fine
    check_run_dir(tmp_path)
