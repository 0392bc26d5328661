"""One layout rule for trainer, planner, converter and launch plan.

Every recipe under examples/ is validated for its world size (cluster.trainer_nodes x
cluster.gpus_per_node) with the trainer's own validation (`ParallelSizes.problems`, what
`init_parallel` and the engine run; no process group needed), and `sao plan` reads the same etp,
dtype, recompute and attention kernel as the TransformerConfig the trainer would build on a GPU node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_sao.cluster.planner import PlanOptions, plan, resolve_hf_config
from megatron_sao.config import load_config
from megatron_sao.models.builtin import is_builtin, materialize_builtin_model
from megatron_sao.models.hf_config import model_spec_from_hf
from megatron_sao.trainer import components as C
from tests.paths import REPO

RECIPES = REPO / "examples" / "qwen3_30b_a3b"
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))
CLUSTER_RECIPES = sorted(RECIPES.glob("*.yaml"))
# SmolLM2-135M-Instruct as tools/prepare_smollm2.py writes it (its docstring / checks list these).
SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="silu")


def recipe_spec(cfg, tmp_path: Path):
    """The ModelSpec a recipe trains: a built-in model, a known hub checkpoint, or SmolLM2's config."""
    if is_builtin(cfg.model.path):
        return C.model_spec(materialize_builtin_model(cfg.model.path, tmp_path / cfg.model.path, seed=0))
    if cfg.model.path.endswith("smollm2/hf"):
        return model_spec_from_hf(SMOLLM2)
    return resolve_hf_config(cfg)


def test_every_example_is_covered():
    assert len(EXAMPLES) >= 7 and set(CLUSTER_RECIPES) <= set(EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_every_recipe_layout_passes_the_trainers_validation(path, tmp_path):
    cfg = load_config(path)
    spec = recipe_spec(cfg, tmp_path)
    world = cfg.cluster.trainer_nodes * cfg.cluster.gpus_per_node
    sizes = C.parallel_sizes(cfg)  # what `sao train` hands init_parallel and the engines
    sizes.validate_for(spec, world_size=world)  # raises, naming the config key, if the trainer would refuse it
    if spec.is_moe and cfg.parallel.etp is None and cfg.parallel.ep >= cfg.parallel.tp:
        assert sizes.expert_tp == 1  # experts whole on their EP rank (published Qwen3-30B-A3B recipes)


def _trainer_kwargs(cfg, spec):
    """The TransformerConfig fields a GPU node builds for `cfg`: exactly what build_actor/build_critic
    hand the engine (sizes, params_dtype, overrides), on the TransformerEngine kernel set."""
    from megatron_sao.models.gpt import transformer_config_kwargs

    return transformer_config_kwargs(spec, C.parallel_sizes(cfg), params_dtype=C.params_dtype(cfg), use_te=True,
                                     **C.engine_overrides(cfg))


@pytest.mark.parametrize("path", CLUSTER_RECIPES, ids=lambda p: p.name)
def test_plan_and_trainer_read_the_same_settings(path):
    from megatron_sao.models.gpt import config_attention_kernel

    cfg = load_config(path)
    spec = resolve_hf_config(cfg)
    p = plan(cfg, spec)
    kw = _trainer_kwargs(cfg, spec)
    assert p.fits, p.problems
    assert kw["expert_tensor_parallel_size"] == p.layout.etp == 1
    assert (kw["tensor_model_parallel_size"], kw["expert_model_parallel_size"]) == (p.layout.tp, p.layout.ep)
    assert kw["params_dtype"] == torch.bfloat16 and kw["bf16"] and p.dtype == "bfloat16"  # cluster recipes train bf16
    assert (kw.get("recompute_granularity") == "full") == p.recompute
    assert config_attention_kernel(kw) == p.attention == "fused"  # no s x s matrix


@pytest.mark.parametrize("overrides,kernel", [([], "fused"), (["model.dtype=float32"], "unfused")])
def test_attention_kernel_follows_the_dtype_in_both(overrides, kernel):
    """fp32 switches TE off its fused attention (s x s scores): the planner counts that, the trainer
    selects it, and at 128K tokens the planner refuses the run."""
    from megatron_sao.models.gpt import config_attention_kernel

    cfg = load_config(RECIPES / "aime_disaggregated.yaml", overrides)
    spec = resolve_hf_config(cfg)
    p = plan(cfg, spec)
    assert config_attention_kernel(_trainer_kwargs(cfg, spec)) == p.attention == kernel
    assert p.fits == (kernel == "fused")


def test_config_that_needs_recompute_is_refused_without_it():
    cfg = load_config(RECIPES / "aime_disaggregated.yaml", ["parallel.recompute=none"])
    spec = resolve_hf_config(cfg)
    p = plan(cfg, spec)
    assert p.recompute_needed and not p.recompute and "recompute_granularity" not in _trainer_kwargs(cfg, spec)
    assert [i.field for i in p.problems] == ["parallel.recompute"]
    assert "parallel.recompute: full" in p.problems[0].reason


def test_etp_is_one_rule_for_trainer_planner_converter_and_launch():
    """parallel.etp unset: the trainer's ParallelSizes, the planner's layout, the conversion command
    and the launch plan's memory check all use etp = 1 for the AIME recipe (tp 4, ep 32)."""
    from megatron_sao.cluster.convert_cmd import convert_argv

    path = str(RECIPES / "aime_disaggregated.yaml")
    cfg = load_config(path)
    assert cfg.parallel.etp is None
    argv = convert_argv(path, "hf-to-megatron", hf_dir="/hf", megatron_dir="/mg")
    assert argv[argv.index("--etp") + 1] == "1"
    assert C.parallel_sizes(cfg).expert_tp == plan(cfg, resolve_hf_config(cfg)).layout.etp == 1
    # An explicit parallel.etp wins everywhere; one the trainer refuses is refused by the planner too.
    cfg4 = load_config(path, ["parallel.etp=4"])
    with pytest.raises(Exception, match="expert grid"):
        plan(cfg4, resolve_hf_config(cfg4), PlanOptions())
    with pytest.raises(ValueError, match="expert grid"):
        C.parallel_sizes(cfg4).validate_for(resolve_hf_config(cfg4), world_size=32)


def test_moe_tp_above_ep_times_etp_is_refused_naming_parallel_etp():
    """The engine's protection (MoE with etp*ep < tp trains with wrong gradients on megatron-core
    0.16.1) is part of the shared rules: an explicit etp=1 with ep=1 < tp=4 is refused by the
    trainer's validation and the planner alike, naming parallel.etp; unset, the default rule
    picks etp = tp for that layout, which passes."""
    from megatron_sao.cluster.layout import LayoutError

    base = ["parallel.ep=1", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1"]
    cfg = load_config(RECIPES / "online_style.yaml", [*base, "parallel.tp=4", "parallel.etp=1"])
    spec = resolve_hf_config(cfg)
    problems = C.parallel_sizes(cfg).problems(spec, 8)
    assert [p.field for p in problems] == ["parallel.etp"] and "wrong gradients" in problems[0].reason
    with pytest.raises(LayoutError, match="parallel.etp"):
        plan(cfg, spec)
    cfg = load_config(RECIPES / "online_style.yaml", [*base, "parallel.tp=4"])
    assert C.parallel_sizes(cfg).expert_tp == 4 and C.parallel_sizes(cfg).problems(spec, 8) == []
