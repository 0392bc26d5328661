"""On a CPU the engine accumulates weight gradients inside the GEMM, into Megatron's gradient buffer
(megatron/wgrad_accumulation.py), and trains exactly as without: tied embeddings (the LM head's and the
embedding's gradients meet in one buffer), MoE experts, actor and critic.

Runs in a fresh interpreter (Megatron's parallel state is process-global): two engines per role from one
HF model, `gradient_accumulation_fusion` on (the engine's default on a CPU) and off, three steps each.
"""

import subprocess
import sys

import pytest

from tests.paths import REPO

PROBE = r"""
import sys, tempfile, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from megatron_sao.megatron.cpu_compat import ensure_cpu_compat
ensure_cpu_compat()
from megatron_sao.config import AlgorithmConfig
from megatron_sao.megatron.engine import InitSource, MegatronEngine
from megatron_sao.megatron.optimizer import OptimConfig
from megatron_sao.models.hf_config import model_spec_from_hf
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.models.presets import tiny_hf_config
from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn

torch.manual_seed(0)
hf = Path(tempfile.mkdtemp()) / "hf"
AutoModelForCausalLM.from_config(tiny_hf_config(sys.argv[1]), dtype=torch.float32).save_pretrained(hf)
spec = model_spec_from_hf(AutoModelForCausalLM.from_pretrained(hf).config)
g = torch.Generator().manual_seed(0)
batch = dict(tokens=torch.randint(0, spec.vocab_size, (4, 24), generator=g),
             attention_mask=torch.ones(4, 24, dtype=torch.bool), action_mask=torch.ones(4, 24, dtype=torch.bool),
             advantages=torch.randn(4, 24, generator=g), returns=torch.randn(4, 24, generator=g))
ctx = None
for role in ("actor", "critic"):
    engines = []
    for fused in (None, False):  # None: the engine's own choice
        overrides = {} if fused is None else {"gradient_accumulation_fusion": fused}
        e = MegatronEngine(spec, ParallelSizes(), OptimConfig(lr=1e-3), role=role, init=InitSource.from_hf(str(hf)),
                           micro_batch_size=2, config_overrides=overrides, ctx=ctx)
        ctx = e.ctx
        engines.append(e)
    assert [e.config.gradient_accumulation_fusion for e in engines] == [True, False]
    if role == "actor":
        batch["rollout_logprobs"] = engines[0].logprobs(batch)
    loss = policy_loss_fn(AlgorithmConfig(name="sao")) if role == "actor" else critic_loss_fn()
    start = {k: v.detach().clone() for k, v in engines[0].ddp.module.named_parameters()}
    norms = [[e.train_step(batch, loss).grad_norm for _ in range(3)] for e in engines]
    p = [dict(e.ddp.module.named_parameters()) for e in engines]
    diff = max((p[0][k] - p[1][k]).abs().max().item() for k in p[0])
    moved = min((p[0][k] - start[k]).abs().max().item() for k in p[0] if p[0][k].requires_grad)
    assert abs(norms[0][0] - norms[1][0]) < 1e-6 * norms[1][0], norms
    assert diff < 1e-5 and moved > 1e-4, (role, diff, moved)  # every weight trained, both ways alike
    print(role, "ok", norms[0], diff, moved)
print("ok")
"""


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])  # tied embeddings; MoE experts (untied)
def test_fused_weight_gradients_train_like_autograds(arch):
    proc = subprocess.run([sys.executable, "-c", PROBE, arch], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
