"""Does the rollout tier scale with servers? Trajectories per second over 1, 2, 4 servers, and the time
of one streamed weight update to 1 and 2 servers.

For each server count N it starts N rollout server processes of the tiny MoE model with the launch
plan's own commands (`launch_local.build_local_plan`, the code `slurm/sao_aime.sh` uses), connects the
trainer's rollout side to them (`RolloutSide`: the same placement, per-server cap, episode driver and
weight sync the trainer uses) and runs ``--episodes`` toy-tool episodes (async admission, nothing
waits for a trainer), pushing a full weight update every ``--batch`` finished trajectories as a
trainer step would. Reported per N: trajectories/s, the ratio to N=1 (in the same run: the machine
is shared and noisy), the median update time, the episodes each server took, and a control: the
generate requests/s of the servers alone under plain HTTP load (4 clients per server), which says
whether a flat ratio comes from the servers (the machine) or from the rollout side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rollout_servers.py --server vllm --servers 1,2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rollout_servers.py --server sao --servers 1,2,4

``--server vllm``: real `vllm serve` processes of the CPU build (~2 GiB each; weights over the gloo
transfer groups); ``--server sao``: rollout/engines/http_server.py (HF engine, weights over HTTP). Each server is
pinned to one core (VLLM_CPU_OMP_THREADS_BIND / OMP_NUM_THREADS=1), so on a machine with C cores
more than C servers cannot run faster: read the ratios against the core count printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "tests" / "e2e" / "tiny_ci.yaml"


def _side(cfg, model_dir: Path, urls: list[str], on_done, args):
    """The trainer's rollout side over the servers at `urls` (what build_rollout_side makes, with
    admission wide open: nothing waits for a trainer step here)."""
    from megatron_sao.cluster.layout import max_num_seqs
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.rollout.engines.factory import make_engines
    from megatron_sao.rollout.prompts import PromptStream
    from megatron_sao.rollout.rollout_side import RolloutSide, RolloutSideConfig
    from megatron_sao.trainer import components as C

    side_cfg = RolloutSideConfig(batch_size=args.batch, ahead=10_000, concurrency=args.concurrency,
                                 max_num_seqs=max_num_seqs(cfg, len(urls)), sync_timeout_s=300, health_interval_s=0)
    return RolloutSide(make_engines(C.engine_config(cfg, model_dir)), C.env_factory(cfg),
                       PromptStream(C.train_tasks(cfg), cfg.run.seed), ChatFormatter(C.load_tokenizer(cfg, model_dir)),
                       C.agent_loop_config(cfg), on_done, side_cfg, labels=urls)


def raw_requests_per_s(urls: list[str], per_server: int, requests: int) -> float:
    """The servers alone: generate requests/s with `per_server` plain HTTP clients per server (no
    driver, no environment): separates what the servers can do from what the rollout side does."""
    import threading
    import urllib.request

    body = json.dumps({"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 12, "logprobs": 0}}).encode()

    def load(url: str) -> None:
        for _ in range(requests):
            req = urllib.request.Request(url + "/inference/v1/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=120).read()
    threads = [threading.Thread(target=load, args=(u,)) for u in urls for _ in range(per_server)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(threads) * requests / (time.monotonic() - t0)


def bench(n: int, args, tmp: Path) -> dict:
    from safetensors.torch import load_file

    from megatron_sao.cluster.launch_local import build_local_plan
    from megatron_sao.cluster.supervisor import Supervisor
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import resolve_model_dir

    run = tmp / f"n{n}"
    overrides = [f"rollout.concurrency={args.concurrency}", "rollout.max_turns=3", "rollout.timeout_s=300",
                 'rollout.vllm_serve_args=["--kv-cache-memory-bytes", "33554432", "--enforce-eager"]']
    plan = build_local_plan(str(CONFIG), trainer_ranks=1, rollout_servers=n, run_dir=str(run), overrides=overrides,
                            server=args.server)
    cfg = load_config(str(CONFIG), [*overrides, *plan.plan.trainer_overrides])
    model_dir = resolve_model_dir(cfg.model.path, run, cfg.run.seed)
    state = load_file(str(model_dir / "model.safetensors"))
    names = list(state)
    buckets = lambda: ([(k, state[k]) for k in names[i:i + 8]] for i in range(0, len(names), 8))  # noqa: E731
    done: list = []
    with Supervisor(grace_s=20) as sup:
        t0 = time.monotonic()
        for s in plan.servers:
            sup.start(s.name, s.argv, s.log, s.env)
        sup.wait_healthy(plan.health, 900)
        startup = time.monotonic() - t0
        raw_rps = raw_requests_per_s(plan.server_urls, per_server=4, requests=args.raw_requests)
        side = _side(cfg, model_dir, plan.server_urls, done.append, args)
        side.start()
        try:
            version, syncs = 0, []
            while len(done) < args.warmup:  # connections, first requests, prefix caches
                time.sleep(0.05)
            version += 1
            syncs.append(side.push_weights(buckets(), version).seconds)
            n0, t_start = len(done), time.monotonic()
            while len(done) - n0 < args.episodes:
                if (len(done) - n0) // args.batch >= version:  # a trainer step's worth: push weights
                    version += 1
                    syncs.append(side.push_weights(buckets(), version).seconds)
                if side.error is not None:
                    raise RuntimeError(side.error)
                time.sleep(0.02)
            secs = time.monotonic() - t_start
            metrics = side.metrics()
        finally:
            side.close()
    trajs = done[n0:n0 + args.episodes]
    return {"servers": n, "startup_s": round(startup, 1), "episodes": args.episodes, "seconds": round(secs, 2),
            "trajectories_per_s": round(args.episodes / secs, 3), "raw_requests_per_s": round(raw_rps, 2),
            "tokens_per_s": round(sum(t.length for t in trajs) / secs, 1),
            "failed": sum(not t.trainable for t in trajs), "weight_updates": len(syncs),
            "update_median_s": round(statistics.median(syncs), 4),
            "episodes_by_server": metrics["rollout/episodes_by_server"],
            "started_by_server": metrics["rollout/episodes_started_by_server"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", choices=("vllm", "sao"), default="vllm")
    p.add_argument("--servers", default="1,2,4", help="comma list of server counts")
    p.add_argument("--episodes", type=int, default=96, help="timed episodes per server count")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="trajectories per simulated trainer step (one update each)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--raw-requests", type=int, default=20, help="per plain client in the servers-only control")
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    args = p.parse_args()
    print(f"# {os.cpu_count()} cores; {args.server} servers; {args.episodes} episodes each, "
          f"concurrency {args.concurrency}, an update every {args.batch}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.servers.split(",")]:
            r = bench(n, args, Path(tmp))
            results.append(r)
            base = results[0]["trajectories_per_s"]
            print(f"{n} server(s): {r['trajectories_per_s']:.3f} traj/s (x{r['trajectories_per_s'] / base:.2f} of "
                  f"{results[0]['servers']}); servers alone {r['raw_requests_per_s']:.1f} requests/s (x"
                  f"{r['raw_requests_per_s'] / results[0]['raw_requests_per_s']:.2f}); "
                  f"update {r['update_median_s'] * 1e3:.0f} ms median of "
                  f"{r['weight_updates']}, startup {r['startup_s']} s, "
                  f"by server {list(r['episodes_by_server'].values())}",
                  flush=True)
    for r in results:
        r["ratio_to_first"] = round(r["trajectories_per_s"] / results[0]["trajectories_per_s"], 3)
        r["raw_ratio_to_first"] = round(r["raw_requests_per_s"] / results[0]["raw_requests_per_s"], 3)
    summary = {"server": args.server, "cores": os.cpu_count(), "results": results}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
