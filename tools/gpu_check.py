"""`make gpu-check`: the trainer's GPU path end to end on one machine, written to one JSON of figures.

    python tools/gpu_check.py --out gpu_check.json            # a CUDA machine: bf16 on NCCL, < 8 min on one GPU
    python tools/gpu_check.py --out smoke.json --smoke        # any machine: tiny shapes, gloo, fp32 (the CI test)

What it runs, each section in its own try/except (an error is recorded in the JSON and the next
section runs; the JSON is rewritten after every section, so a killed run leaves what it measured):
  env          torch / CUDA / GPU / megatron-core / TransformerEngine versions
  build        a scaled Qwen3-MoE (the Qwen3-30B-A3B layer: hidden 2048, 32/4 heads of 128, 128 experts
               top-8 of width 768; 2 layers) as a random HF checkpoint, loaded into an actor and a critic
               MegatronEngine in bf16 (params_dtype) on NCCL, world size 1
  parity       actor log-probs and critic values; log-probs against HF transformers in fp32 on the same
               weights (the bf16 error, with PARITY_TOL)
  export       the actor's HF weight export, streamed: buckets counted, GPU memory it added, exact vs disk
  train        one DIS actor step and one critic step (the trainer's own loss closures)
  memory       per-layer activation bytes (torch.cuda.memory_allocated at each decoder layer's entry during
               a train step's forward) and the step's peak, against cluster/memory.py's formulas
  logits       the actor's log-prob stage at one 64K-token micro-batch with the real vocabulary (bf16
               logits, chunked log-softmax forward + backward): peak GPU memory against the planner's term
  generate     the HF rollout engine generating on the GPU (tokens/s, log-probs finite)
  colocated    the colocated placement on one GPU (tools/gpu_check_colocated.py): trainer offloaded, a vLLM
               engine shard built in this process (external launcher, sleep mode), woken with the actor's
               weights loaded in-process, generate; sleep, trainer back, train step, offload, wake, reload,
               generate; GPU memory (mem_get_info and torch's allocator) after every call. Needs vLLM:
               on a machine without it the section is skipped ("ok": null, listed in skipped_sections)
  mfu          train-step MFU of the Qwen3-30B-A3B layer shape (2 layers, small vocab so the layers
               dominate; FLOPs formula of benchmarks/bench_mfu.py)
The project's GPU machine (one H200, no internet): tools/gpu_check_device.sh; docs/cluster.md says how
to carry wheels it lacks (megatron-core).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_check_sections import NEEDS, SECTIONS, SHAPES  # noqa: E402  (tools/ is on sys.path when run as a script)


def _missing(modules: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


class Check:
    """Sections run in order; each records {ok, seconds, error?, ...figures} and rewrites the JSON."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline, self.t0 = out, time.monotonic() + budget_s, time.monotonic()
        self.figures: dict = {"sections": {}}
        self.state: dict = {}

    def run(self, name: str, fn) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.figures["sections"][name] = {"ok": False, "skipped": f"time budget spent ({self.elapsed():.0f}s)"}
            return self._write()
        missing = _missing(NEEDS.get(name, ()))
        if missing:  # not a failure of the trainer's GPU path: this machine lacks the package
            self.figures["sections"][name] = {"ok": None, "skipped": f"not installed here: {missing}"}
            print(f"[gpu-check {self.elapsed():6.1f}s] {name}: skipped (not installed: {missing})", flush=True)
            return self._write()
        print(f"[gpu-check {self.elapsed():6.1f}s] {name} ...", flush=True)
        t0, rec = time.monotonic(), {}
        try:
            rec.update(fn(self.state) or {})
            rec["ok"] = not rec.get("failed_checks")
        except Exception as e:  # record and go on: the point is to see every section
            rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - t0, 2)
        self.figures["sections"][name] = rec
        print(f"[gpu-check {self.elapsed():6.1f}s] {name}: {'ok' if rec['ok'] else 'FAILED'} "
              f"{rec.get('error', '')}", flush=True)
        self._write()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _write(self) -> None:
        self.figures["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.figures, indent=1, default=str))
        tmp.replace(self.out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON of figures (rewritten after every section)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, fp32; runs on a CPU (gloo)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="sections not started by then are skipped")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200 SXM: 989)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list, in order (env and build first)")
    args = ap.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; have {list(SECTIONS)}")
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget_s)
    with tempfile.TemporaryDirectory(prefix="sao-gpu-check-") as tmp:
        check.state.update(smoke=args.smoke, shape=SHAPES["smoke" if args.smoke else "full"], tmp=tmp,
                           peak_tflops=args.peak_tflops)
        for name in names:
            check.run(name, SECTIONS[name])
        check.state.clear()
    try:
        from megatron_sao.megatron.parallel import destroy_parallel

        destroy_parallel()  # NCCL wants its communicators destroyed before exit
    except Exception as e:  # the figures are written; say it and finish
        print(f"[gpu-check] destroy_parallel: {e!r}", flush=True)
    failed = [k for k, v in check.figures["sections"].items() if v.get("ok") is False]
    check.figures["failed_sections"] = failed
    check.figures["skipped_sections"] = [k for k, v in check.figures["sections"].items() if v.get("ok") is None]
    check._write()
    print(f"[gpu-check] wrote {out}; failed sections: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
