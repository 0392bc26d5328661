"""Checkpoint commit, retention, verification and fallback; the run directory's refusal and cleanup."""

import json
import zipfile

import pytest
import torch

from megatron_sao.errors import UserError
from megatron_sao.trainer import checkpoints as C
from megatron_sao.trainer.run_dir import RunDir, check_run_dir, check_train_dir


def _parts(d):
    """An engine directory with the files of a Megatron distributed checkpoint (megatron/dist_state.py)."""
    (d / "actor").mkdir()
    torch.save({"sao": {"w": torch.arange(1000.0)}}, d / "actor" / "common.pt")
    (d / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
    (d / "actor" / ".metadata").write_bytes(b"index")
    (d / "actor" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')


def save(root, step):
    return C.save(root, step, _parts, {"step": step, "rng": {"x": 1}}, is_writer=True)


def test_commit_keeps_two_and_resume_candidates_skip_uncommitted(tmp_path):
    assert save(tmp_path, 1) is None
    assert save(tmp_path, 2) == tmp_path / "step_000001"
    prev = save(tmp_path, 3)
    assert prev == tmp_path / "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]
    manifest = json.loads((tmp_path / "step_000003" / C.MANIFEST).read_text())["files"]
    assert set(manifest) == {"actor/common.pt", "actor/__0_0.distcp", "actor/.metadata", "actor/metadata.json",
                             "rng.pt", "trainer_state.json"}
    # A kill between the rename and the rewrite of `latest`: step 4 exists but was never committed.
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000005.tmp").mkdir()
    assert C.candidates(tmp_path) == [tmp_path / "step_000003", tmp_path / "step_000002"]
    assert {p.name for p in C.remove_uncommitted(tmp_path)} == {"step_000004", "step_000005.tmp"}
    # Saving the step a resumed run started from keeps the older one as the fallback.
    assert save(tmp_path, 3) == tmp_path / "step_000002"


def _flip_tensor_byte(path):
    """Flip a byte inside a torch file's tensor data: same size, bad zip CRC."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    data[info.header_offset + 200] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damage_names_the_file(tmp_path):
    save(tmp_path, 1)
    ck = tmp_path / "step_000001"
    assert C.damage(ck) is None
    common = ck / "actor" / "common.pt"
    _flip_tensor_byte(common)
    assert str(common) in C.damage(ck) and "CRC" in C.damage(ck)
    shard = ck / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"{shard} has 100 bytes" in C.damage(ck)
    (ck / C.MANIFEST).unlink()  # a checkpoint without a manifest: its engine index is still checked
    (ck / "actor" / ".metadata").unlink()
    assert f"{ck / 'actor' / '.metadata'} is missing" in C.damage(ck)
    (ck / "trainer_state.json").write_text('{"step": ')
    assert "trainer_state.json is unreadable" in C.damage(ck)


def test_damage_of_a_per_rank_checkpoint_checks_every_rank_file(tmp_path):
    """An engine directory of the format written before distributed checkpoints (megatron/state_io.py)."""
    def legacy(d):
        (d / "critic").mkdir()
        (d / "critic" / "meta.json").write_text('{"format": "megatron_sao.engine/1"}')
        for r in range(2):
            torch.save({"w": torch.arange(1000.0)}, d / "critic" / f"rank_{r:05d}.pt")
    C.save(tmp_path, 1, legacy, {"step": 1, "rng": {"x": 1}}, is_writer=True)
    ck = tmp_path / "step_000001"
    assert C.damage(ck) is None
    _flip_tensor_byte(ck / "critic" / "rank_00001.pt")
    assert f"{ck / 'critic' / 'rank_00001.pt'} is corrupted (CRC" in C.damage(ck)


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


class _Writers:
    """Stands in for megatron/async_saves.py::AsyncSaves (one process, writers that finish on request)."""

    def __init__(self):
        self.finalize, self.done = None, False

    @property
    def pending(self):
        return self.finalize is not None

    def schedule(self, requests, finalize):
        assert requests and self.finalize is None
        self.finalize = finalize

    def poll(self):
        if self.done and self.finalize:
            self.finalize()
            self.finalize = None

    def wait(self):
        self.done = True
        self.poll()
        self.done = False

    def abort(self):
        self.finalize = None


def test_an_asynchronous_checkpoint_commits_only_once_written(tmp_path):
    writers, released = _Writers(), []
    ck = C.Checkpointer(tmp_path, is_writer=True, asynchronous=True, barrier=lambda: None, broadcast=lambda x: x,
                        gate=lambda what: None, saves=writers)

    def parts(d):
        _parts(d)
        return ["request"]
    ck.save(1, parts, {"step": 1, "rng": {"x": 1}}, released.append)
    ck.poll()  # the writers are not done: nothing is committed, nothing released
    assert C.committed(tmp_path) is None and released == [] and [p.name[:16] for p in tmp_path.iterdir()] == [
        "step_000001.tmp-"]
    m = ck.take_metrics()
    assert m["checkpoint/step"] == 1 and m["checkpoint/blocked_s"] >= 0 and "checkpoint/write_s" not in m
    writers.done = True
    ck.poll()
    assert C.committed(tmp_path) == tmp_path / "step_000001" and released == [None]
    state = json.loads((tmp_path / "step_000001" / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["save"]["asynchronous"] is True and state["save"]["write_s"] >= 0
    assert ck.take_metrics()["checkpoint/committed_step"] == 1
    ck.save(2, parts, {"step": 2, "rng": {"x": 1}}, released.append)  # in flight ...
    ck.save(3, parts, {"step": 3, "rng": {"x": 1}}, released.append)  # ... so this save waits for it first
    assert C.committed(tmp_path) == tmp_path / "step_000002" and released == [None, tmp_path / "step_000001"]
    ck.abort()  # step 3 is abandoned: never committed
    assert C.committed(tmp_path) == tmp_path / "step_000002"


def test_an_old_per_rank_checkpoint_at_another_layout_is_refused_naming_the_conversion(tmp_path):
    from types import SimpleNamespace

    from megatron_sao.megatron import state_io

    ctx = SimpleNamespace(tp=1, pp=1, ep=1, etp=1, sequence_parallel=False, world_size=1, rank=0)
    engine = SimpleNamespace(ctx=ctx, role="actor", spec=SimpleNamespace(to_dict=lambda: {"arch": "x"}),
                             optim_config=SimpleNamespace(use_distributed_optimizer=False))
    meta = {"format": "megatron_sao.engine/1", "role": "actor", "spec": {"arch": "x"}, "tp": 2, "pp": 1, "ep": 1,
            "etp": 1, "sequence_parallel": True, "world_size": 2, "distributed_optimizer": False}
    with pytest.raises(ValueError, match=r"per-rank checkpoint .* loads only at the layout that wrote it.*'tp': 2.*"
                                         r"Convert it by resuming once at that layout"):
        state_io.load_engine_state(engine, str(tmp_path), meta)
