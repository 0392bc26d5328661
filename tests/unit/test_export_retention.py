"""The run directory's side of run.export_every: a killed export's temp directory is removed at the
next start, and a resume drops the exports of the steps it trains again."""

from megatron_sao.trainer.run_dir import RunDir


def test_resume_drops_later_exports_and_start_removes_half_written_ones(tmp_path):
    exports = tmp_path / "exports"
    for name in ("step_000002", "step_000004", ".step_000006.tmp-123-abcd1234"):
        (exports / name).mkdir(parents=True)
        (exports / name / "model.safetensors").write_bytes(b"x")
    rd = RunDir(tmp_path)
    gone = rd.remove_stale()
    assert exports / ".step_000006.tmp-123-abcd1234" in gone
    assert sorted(p.name for p in exports.iterdir()) == ["step_000002", "step_000004"]
    rd.truncate_logs(3)  # resumed from the checkpoint of step 3: step 4 is trained (and exported) again
    assert sorted(p.name for p in exports.iterdir()) == ["step_000002"]
    rd.clear_training()  # --overwrite
    assert not exports.exists()
