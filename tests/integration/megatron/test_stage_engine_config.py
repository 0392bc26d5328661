"""Every stage (sft, value-pretrain, train) builds its engines with the config's `parallel.recompute`
and `model.dtype`: read back from the TransformerConfig and the parameters of the engines the real
CLI built (workers/stage_engines.py records them), with bf16 mixed precision on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

WORKER = "tests.integration.megatron.workers.stage_engines"
CONFIG = os.path.join(REPO, "tests", "e2e", "tiny_ci.yaml")
COMMON = ["parallel.recompute=full", "model.dtype=bfloat16", "run.console=none"]
STAGES = {  # stage -> (overrides, the roles it builds)
    "sft": (["sft.steps=1", "sft.batch_size=8", "sft.demonstrations=64", "sft.eval=false"], ["actor"]),
    "value-pretrain": (["value_pretrain.rollouts=4", "value_pretrain.steps=1", "value_pretrain.batch_size=4",
                        "value_pretrain.value_head_lr=0.003", "critic.value_head_lr=0.0005"], ["critic"]),
    "train": (["run.total_steps=1", "algorithm.critic_warmup_steps=0", "trainer.mode=sync",
               "critic.value_head_lr=0.0005"], ["actor", "critic"]),
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    out = {}
    for stage, (overrides, _) in STAGES.items():  # in order: each stage reads the previous one's output
        record = tmp / f"{stage}.jsonl"
        proc = subprocess.run([sys.executable, "-m", WORKER, str(record), stage, CONFIG, f"run.dir={tmp / 'run'}",
                               *COMMON, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{stage}: " + proc.stdout[-2000:] + proc.stderr[-4000:]
        out[stage] = [json.loads(line) for line in record.read_text().splitlines()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_recompute_and_dtype_reach_every_engine_of_every_stage(records, stage):
    rows = [r for r in records[stage] if r["role"] in ("actor", "critic")]
    assert sorted(r["role"] for r in rows) == sorted(STAGES[stage][1]), rows
    for r in rows:
        assert (r["recompute_granularity"], r["recompute_method"], r["recompute_num_layers"]) == \
            ("full", "uniform", 1), r
        assert r["params_dtype"] == "torch.bfloat16" and r["bf16"], r
        assert r["model_param_dtypes"] == ["torch.bfloat16"], r  # the model trains in bf16 ...
        assert r["main_param_dtypes"] == ["torch.float32"], r  # ... on fp32 main params in the optimizer
        assert r["attention_backend"] == "local", r  # no TE on a CPU: the local spec


@pytest.mark.slow
def test_the_critic_head_starts_at_zero_with_its_own_lr_and_the_mean_return_bias(records):
    """Value pretraining builds a fresh zero head from the SFT policy, gives it value_pretrain.value_head_lr
    (the rest keeps critic.optim.lr), and sets its bias to the training split's mean return in the bf16
    model and in the fp32 main copy the optimizer updates; `sao train` then loads the pretrained head and
    trains it at critic.value_head_lr."""
    head = next(r for r in records["value-pretrain"] if r["role"] == "critic_head")
    assert head["fresh_value_head"] and head["head_weight_absmax"] == 0.0
    assert head["head_lr"] == head["bias_lr"] == pytest.approx(0.003)
    assert head["mlp_lr"] == pytest.approx(1.0e-3)  # tiny_ci.yaml's critic.optim.lr
    bias = [r for r in records["value-pretrain"] if r["role"] == "bias_set"]
    assert len(bias) == 1 and bias[0]["main"] == [bias[0]["value"]]
    assert bias[0]["model"] == pytest.approx(bias[0]["value"], abs=1e-2)  # bf16
    trained = next(r for r in records["train"] if r["role"] == "critic_head")
    assert not trained["fresh_value_head"] and trained["head_lr"] == trained["bias_lr"] == pytest.approx(5e-4)
    assert trained["mlp_lr"] == pytest.approx(1.0e-3)
    assert not [r for r in records["train"] if r["role"] == "bias_set"]
