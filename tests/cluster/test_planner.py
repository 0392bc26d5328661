"""`sao plan`: recipes fit, memory numbers match hand calculations, impossible layouts are refused."""

import pytest

from megatron_sao.cluster import memory as mem
from megatron_sao.cluster.layout import LayoutError
from megatron_sao.cluster.planner import PlanOptions, main, plan
from megatron_sao.config import load_config
from tests.cluster.recipes import RECIPES

AIME = str(RECIPES / "aime_disaggregated.yaml")
RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))


def test_there_are_four_recipes():
    assert {p.name for p in RECIPE_FILES} >= {"aime_disaggregated.yaml", "aime_colocated.yaml",
                                              "coding_disaggregated.yaml", "online_style.yaml"}


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_recipes_load_and_fit_80gib(path, qwen_long):
    cfg = load_config(path)
    p = plan(cfg, qwen_long, PlanOptions(gpu_mem_gib=80))
    assert p.fits, p.problems
    assert p.trainer_peak < 80 * mem.GIB
    assert cfg.model.dtype == "bfloat16" and cfg.critic.freeze == ["attention", "embeddings", "router", "norms"]


def test_aime_recipe_has_paper_settings():
    cfg = load_config(AIME)
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high, a.critic_steps, a.critic_warmup_steps, a.policy_alpha) == (0.3, 5.0, 2, 10, 1.5)
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr, cfg.buffer.batch_size) == (1e-6, 5e-6, 128)
    assert (cfg.rollout.max_total_tokens, cfg.rollout.max_turns) == (131072, 50)
    coding = load_config(RECIPES / "coding_disaggregated.yaml").algorithm
    assert (coding.eps_low, coding.eps_high) == (0.8, 3.0)


def test_aime_memory_by_hand(qwen_long):
    """tp=4, ep=32, etp=1 on 32 GPUs: dp=8, edp=1; the distributed optimizer's 6 + 12/d per param."""
    p = plan(load_config(AIME), qwen_long)
    L = p.layout
    assert (L.world, L.dp, L.edp) == (32, 8, 1)
    h, v = 2048, 152064  # vocab 151936 padded to a multiple of 128 * tp = 512, as the model is built
    attention = h * (4096 + 1024) + 4096 * h
    dense_layer = attention / 4 + 256 + 2 * h + 128 * h  # TP-split attention; replicated norms + router
    dense = 48 * dense_layer + 2 * v * h / 4 + h  # + embedding and LM head (vocab-parallel), final norm
    experts = 48 * 128 * 3 * h * 768 / 32
    assert p.actor.trainable_params == int(dense + experts)
    assert p.actor.weights_grads_optimizer == pytest.approx(dense * (6 + 12 / 8) + experts * 18, rel=1e-12)
    # Critic: frozen attention keeps bf16 weights only; a [1, H] value head replaces the LM head.
    frozen = 48 * (attention / 4 + 256)
    c_dense = 48 * (2 * h + 128 * h) + v * h / 4 + h + h
    assert p.critic.frozen_params == int(frozen)
    assert p.critic.weights_grads_optimizer == pytest.approx(frozen * 2 + c_dense * 7.5 + experts * 18, rel=1e-12)
    # Activations: 48 layers held (pp=1), full recompute keeps 2sbh/t per layer plus one live layer.
    s = 131072
    per_layer = mem.layer_activation_bytes(mem.LayerShape.from_spec(qwen_long), s, 1, 4, True, True, 1)
    assert p.actor.activations == pytest.approx(48 * per_layer)
    assert p.actor.activations_recompute == pytest.approx(48 * 2 * s * h / 4 + per_layer)
    # The log-prob stage: bf16 logits, two fp32 buffers of a 512-row chunk, 33 bytes a token (megatron/logprobs.py).
    assert p.actor.logits == pytest.approx(s * v / 4 * 2 + 2 * 512 * v / 4 * 4 + s * 33) and p.critic.logits == 0
    assert p.recompute_needed and p.recompute  # the recipe sets parallel.recompute: full
    # The step's buffers: the batch (43 bytes a token) and its fp32 outputs (8) on the device, this rank's
    # micro-batches (1/dp of the batch), and 32 cached fp32 RoPE tables of 128 dims.
    batch = 128 * s * (43 + 8) + 16 * s * 43
    assert p.step_buffers == pytest.approx(batch + 32 * s * 128 * 4)
    assert p.trainer_peak == pytest.approx(p.trainer_static + p.step_buffers + p.actor.activations_recompute
                                           + p.actor.logits)
    # vLLM TP=4: bf16 weights / 4; KV of one token = 2 * 48 layers * 1 kv head * 128 * 2 bytes.
    assert p.rollout_weights == pytest.approx(p.total_params * 2 / 4)
    assert p.kv_bytes_per_token == 24576


def test_routing_replay_routes_by_hand(qwen_long):
    """rollout.routing_replay: the routes of one 131072-token micro-batch (48 layers x top-8 in uint8: 128
    experts) go to the GPU for its forward; each of the 48 routers keeps int64 targets of its TP rank's
    chunk (SP: s/4 tokens x 8), plus one router's 5 temporaries; the whole batch's routes stay on the host."""
    off = plan(load_config(AIME), qwen_long)
    on = plan(load_config(AIME, ["rollout.routing_replay=true"]), qwen_long)
    s = 131072
    device = s * 48 * 8 * 1 + (48 + 5) * (s / 4) * 8 * 8
    assert on.actor.routes == on.actor.routes_recompute == pytest.approx(device)  # pp=1: one forward in flight
    assert on.trainer_peak - off.trainer_peak == pytest.approx(device)
    assert on.critic.routes == 0 and off.actor.routes == 0 and off.routes_host == 0
    assert on.routes_host == pytest.approx((128 + 16) * s * 48 * 8)  # batch + this rank's micro-batches
    assert on.fits
    # record_routes carries the same routes (measured, not replayed); a pipeline holds more in flight
    assert plan(load_config(AIME, ["rollout.record_routes=true"]), qwen_long).actor.routes == on.actor.routes
    pp = plan(load_config(AIME, ["rollout.routing_replay=true", "parallel.pp=2", "parallel.ep=16"]), qwen_long)
    assert pp.actor.routes_recompute - pp.actor.routes == pytest.approx(24 * (s / 4) * 8 * 8)  # 2 in flight


def test_route_ids_take_the_smallest_integer_type():
    assert [mem.route_id_bytes(n) for n in (8, 128, 255, 256, 32767, 32768)] == [1, 1, 1, 2, 2, 4]


@pytest.mark.parametrize("overrides,field,fragment", [
    (["parallel.tp=3"], "parallel.tp", "num_attention_heads"),
    (["parallel.tp=8"], "parallel.tp", "num_key_value_heads"),
    (["parallel.pp=5"], "parallel.pp", "num_hidden_layers"),
    (["parallel.ep=24"], "parallel.ep", "num_experts"),
    (["parallel.tp=4", "parallel.pp=3"], "parallel.tp", "trainer world size 32"),
    (["parallel.ep=64"], "parallel.ep", "expert data parallel"),
    (["parallel.sequence_parallel=false"], "parallel.sequence_parallel", "MoE"),
    (["cluster.rollout_nodes=0"], "cluster.rollout_nodes", "disaggregated"),
    (["cluster.rollout_tp=3"], "cluster.rollout_tp", "gpus_per_node"),
    (["rollout.colocate=true"], "rollout.colocate", "disaggregated"),
])
def test_impossible_layouts_are_refused(overrides, field, fragment, qwen_long):
    with pytest.raises(LayoutError) as err:
        plan(load_config(AIME, overrides), qwen_long)
    assert any(i.field == field and fragment in i.reason for i in err.value.issues), err.value.issues


def test_vocab_tp_does_not_divide_is_padded(qwen_dict):
    # 151937 is odd: Megatron pads it to a multiple of 128 * tp (= 512 at tp 4) instead of refusing.
    p = plan(load_config(AIME), {**qwen_dict, "vocab_size": 151937, "max_position_embeddings": 262144})
    assert p.fits and p.padded_vocab == 152064


def test_context_longer_than_the_model_is_refused(qwen_dict):
    # The original Qwen3-30B-A3B has 40960 positions: 128K needs a -2507 checkpoint.
    with pytest.raises(LayoutError, match="rollout.max_total_tokens"):
        plan(load_config(AIME), qwen_dict)


def test_out_of_memory_is_reported_with_numbers(qwen_long):
    p = plan(load_config(AIME, ["cluster.trainer_nodes=2", "parallel.ep=16"]), qwen_long)
    assert not p.fits and p.problems[0].field == "cluster.trainer_nodes"
    assert p.trainer_peak > 80 * mem.GIB
    assert plan(load_config(AIME, ["cluster.trainer_nodes=2", "parallel.ep=16"]), qwen_long,
                PlanOptions(gpu_mem_gib=141)).fits  # the H200 layout the recipe mentions


def test_colocated_counts_each_phase_and_refuses_the_one_that_overflows(qwen_long):
    """Colocated: the engine awake beside an offloaded trainer, the trainer's peak beside a sleeping engine,
    the in-process update (actor params + engine weights + two buckets); each phase must fit."""
    recipe = RECIPES / "aime_colocated.yaml"
    p = plan(load_config(recipe), qwen_long)
    assert p.fits, p.problems
    ph, gib, over = p.colocated, mem.GIB, 4 * mem.GIB
    assert ph.rollout == over + 0.85 * 80 * gib  # vLLM's whole share: the trainer is offloaded then
    assert ph.train == p.trainer_peak + mem.ENGINE_ASLEEP_GIB * gib
    actor_params = (p.actor.trainable_params + p.actor.frozen_params) * 2
    assert ph.update == (over + mem.ENGINE_ASLEEP_GIB * gib + actor_params + p.rollout_weights + 2 * 1024 * 2**20
                         + 151936 * 2048 * 2)  # the embedding is the largest gathered tensor here
    assert ph.host_per_gpu == p.trainer_static - over
    assert p.full_sequences_per_server >= 17  # the offload gives vLLM the GPU: as many as disaggregated
    for override, field in (("rollout.gpu_memory_utilization=0.97", "rollout.gpu_memory_utilization"),
                            ("rollout.weight_sync_bucket_mb=32768", "rollout.weight_sync_bucket_mb"),
                            ("cluster.trainer_nodes=2", "cluster.trainer_nodes")):
        refused = plan(load_config(recipe, [override, "parallel.ep=16"] if "nodes" in override else [override]),
                       qwen_long)
        assert field in [i.field for i in refused.problems], (override, refused.problems)
    assert plan(load_config(AIME), qwen_long).colocated is None  # disaggregated: no phases


def test_kv_cache_smaller_than_one_sequence_is_refused(qwen_long):
    p = plan(load_config(AIME, ["rollout.gpu_memory_utilization=0.2"]), qwen_long)
    assert any(i.field == "rollout.gpu_memory_utilization" and "KV cache" in i.reason for i in p.problems)


def test_main_exit_codes(capsys, tmp_path, qwen_dict):
    import json
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({**qwen_dict, "max_position_embeddings": 262144}))
    assert main([AIME, "--hf-config", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "30.53B params total, 3.35B active" in out and "verdict    fits" in out
    assert main([AIME, "parallel.tp=3", "--hf-config", str(hf)]) == 2
    assert "refused: parallel.tp: tp=3 must divide num_attention_heads=32" in capsys.readouterr().err
    assert main([AIME, "parallel.tpp=3"]) == 2  # config typo: ConfigError names the key
    assert "parallel.tpp" in capsys.readouterr().err
    assert main([AIME, "--json", "--hf-config", str(hf)]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_the_trainer_refuses_on_gpus_what_the_planner_says_runs_out_of_memory(tmp_path, monkeypatch):
    """A job started without the sbatch preflight (SAO_SKIP_PLAN=1 in the sbatch script, or a
    hand-written torchrun) is refused by the trainer before it builds a model, naming the field."""
    from types import SimpleNamespace

    from megatron_sao.config import ConfigError
    from megatron_sao.trainer.components import check_trainer_memory

    no_recompute = load_config(AIME, ["parallel.recompute=none"])
    world = no_recompute.cluster.trainer_nodes * no_recompute.cluster.gpus_per_node
    gpu = SimpleNamespace(backend="nccl", world_size=world, device=None)
    monkeypatch.delenv("SAO_SKIP_PLAN", raising=False)
    with pytest.raises(ConfigError, match="parallel.recompute: without activation recompute"):
        check_trainer_memory(no_recompute, tmp_path, gpu, gpu_mem_gib=80, transformer_engine=True)
    check_trainer_memory(load_config(AIME), tmp_path, gpu, gpu_mem_gib=80, transformer_engine=True)  # as written: fits
    with pytest.raises(ConfigError, match="cluster.trainer_nodes"):  # a GPU node without TE: unfused s x s attention
        check_trainer_memory(load_config(AIME), tmp_path, gpu, gpu_mem_gib=80, transformer_engine=False)
    check_trainer_memory(no_recompute, tmp_path, SimpleNamespace(backend="gloo", world_size=world, device=None))
    monkeypatch.setenv("SAO_SKIP_PLAN", "1")
    check_trainer_memory(no_recompute, tmp_path, gpu, gpu_mem_gib=80, transformer_engine=True)
