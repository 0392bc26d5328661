"""Per-GPU memory formulas: parameters, gradients + optimizer states, activations, vLLM KV cache.

Pure arithmetic on a `ModelSpec` (no torch, no process groups) so every number can be checked by
hand. Sources:

* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198), section 4. Per transformer layer, bf16, sequence s, micro-batch b,
  hidden h, a heads, tensor parallel t:
      no parallelism                 s*b*h*(34 + 5*a*s/h)
      tensor parallel                s*b*h*(10 + 24/t + 5*a*s/(h*t))
      tensor + sequence parallel     s*b*h*(34 + 5*a*s/h) / t
      full recompute (+SP)           2*s*b*h / t        (only the layer input is kept)
  `korthikanti_layer_bytes` is that formula verbatim. `layer_activation_bytes` is the same term
  by term accounting generalised to what Qwen3-MoE changes: query width a*d != h, grouped KV
  heads, q/k RMSNorm, SwiGLU, top-k routed experts sharded over EP/ETP, no dropout, and flash
  attention (no s x s score matrix). With MHA, GeLU 4h, dropout and no flash it reduces exactly to
  the published formula (tests/cluster/test_memory.py checks that).
* Weights + optimizer: Megatron-LM distributed optimizer docs (docs/source/api-guide/
  dist_optimizer.md): bf16 params with fp32 gradient accumulation take 18 bytes/param without the
  distributed optimizer (2 param + 4 grad + 4 fp32 master + 4 Adam m + 4 Adam v) and 6 + 12/d
  with it, d = data-parallel size the optimizer state is sharded over.
* KV cache: 2 (K and V) * layers * kv_heads * head_dim * bytes per token (vLLM's paged cache).

Precision: every formula takes the training dtype's element size (`dtype_bytes`, 2 for bf16, the
default, 4 for fp32). With fp32 params Megatron keeps no separate master copy: 4 (param) + 4 (grad)
+ 8/d (Adam m, v) bytes per param. Whether attention stores the s x s score matrix is the caller's
`flash_attention` flag, which the planner takes from `models.precision.attention_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.models.hf_config import ModelSpec

GIB = 1024**3
BF16 = 2
FP32 = 4


# ------------------------------------------------------------------------------- parameter counts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model, split the way parallelism splits them."""

    embedding: int  # word embeddings [V, H]
    output: int  # LM head [V, H] (0 when tied to the embedding)
    attention: int  # per layer: qkv + output projection (TP-sharded)
    qk_norm: int  # per layer: q/k RMSNorm weights (replicated)
    layer_norms: int  # per layer: input + pre-MLP norm (replicated)
    router: int  # per layer: router [E, H] (replicated)
    experts: int  # per layer: all routed experts (EP x ETP sharded)
    dense_mlp: int  # per layer: SwiGLU MLP of a dense model (TP-sharded)
    final_norm: int
    num_layers: int
    active_experts: int  # per layer: the top-k experts one token uses

    @property
    def per_layer(self) -> int:
        return self.attention + self.qk_norm + self.layer_norms + self.router + self.experts + self.dense_mlp

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.final_norm + self.num_layers * self.per_layer

    @property
    def active(self) -> int:
        """Parameters one token touches (embedding row counted whole, as is the convention)."""
        per_layer = self.per_layer - self.experts + self.active_experts
        return self.embedding + self.output + self.final_norm + self.num_layers * per_layer


def count_params(spec: ModelSpec) -> ParamCounts:
    """Parameter counts of the HF model described by `spec` (Qwen3 / Qwen3-MoE / Llama layout)."""
    h, d = spec.hidden_size, spec.head_dim
    q_dim, kv_dim = spec.num_attention_heads * d, spec.num_kv_heads * d
    one_expert = 3 * h * spec.moe_ffn_hidden_size  # gate, up, down
    return ParamCounts(
        embedding=spec.vocab_size * h,
        output=0 if spec.tie_word_embeddings else spec.vocab_size * h,
        attention=h * (q_dim + 2 * kv_dim) + q_dim * h,
        qk_norm=2 * d if spec.qk_layernorm else 0,
        layer_norms=2 * h,
        router=spec.num_experts * h,
        experts=spec.num_experts * one_expert,
        dense_mlp=0 if spec.is_moe else 3 * h * spec.ffn_hidden_size,
        final_norm=h,
        num_layers=spec.num_layers,
        active_experts=spec.moe_topk * one_expert,
    )


# ------------------------------------------------------------------------------- optimizer bytes


def trainable_bytes_per_param(dp: int, distributed_optimizer: bool = True, param_bytes: int = BF16) -> float:
    """Bytes per trainable param: bf16 param (2) + fp32 grad (4) + fp32 master/m/v (12, sharded over dp).

    fp32 params (`param_bytes`=4) are their own master copy: 4 + 4 + 8 (m, v; sharded over dp).
    """
    if dp < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp}")
    optimizer = (2 if param_bytes == FP32 else 3) * FP32
    return param_bytes + FP32 + (optimizer / dp if distributed_optimizer else optimizer)


FROZEN_BYTES_PER_PARAM = BF16  # frozen params keep only their (bf16) weights: no grad, no Adam state


# ------------------------------------------------------------------------------- activations


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Activation bytes of one GPT layer, Korthikanti et al. 2022 eq. 1-3 (MHA, GeLU 4h, dropout, bf16)."""
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@dataclass(frozen=True)
class LayerShape:
    """What the activation accounting needs from one transformer layer."""

    hidden: int
    heads: int
    q_dim: int  # query (and attention output) width: heads * head_dim
    kv_dim: int  # key/value width: kv_heads * head_dim
    mlp_copies: int  # token copies through the MLP: 1 dense, top-k MoE
    mlp_act_in: int  # width of the activation-function input per copy (GeLU 4h, SwiGLU 2f)
    mlp_act_out: int  # width of the second linear's input per copy (GeLU 4h, SwiGLU f)
    num_experts: int  # router width (0 = dense)
    qk_norm: bool
    dropout: bool

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "LayerShape":
        ffn = spec.moe_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size
        return cls(hidden=spec.hidden_size, heads=spec.num_attention_heads,
                   q_dim=spec.num_attention_heads * spec.head_dim, kv_dim=spec.num_kv_heads * spec.head_dim,
                   mlp_copies=spec.moe_topk if spec.is_moe else 1, mlp_act_in=2 * ffn, mlp_act_out=ffn,
                   num_experts=spec.num_experts, qk_norm=spec.qk_layernorm, dropout=False)

    @classmethod
    def gpt(cls, h: int, a: int) -> "LayerShape":
        """The layer Korthikanti et al. analyse: MHA, GeLU with 4h, dropout on."""
        return cls(hidden=h, heads=a, q_dim=h, kv_dim=h, mlp_copies=1, mlp_act_in=4 * h, mlp_act_out=4 * h,
                   num_experts=0, qk_norm=False, dropout=True)


def layer_activation_bytes(shape: LayerShape, s: int, b: int, tp: int = 1, sequence_parallel: bool = False,
                           flash_attention: bool = True, etp: int | None = None, dtype_bytes: int = BF16) -> float:
    """Activation bytes one layer keeps for backward on one rank (no recompute).

    Terms follow Korthikanti et al. 2022 section 4.1 (bf16); each comment names the published term
    it replaces. `etp` is the expert tensor-parallel size (None: dense layer, or experts sharded like
    dense layers with etp = tp). `dtype_bytes` scales the activation terms (fp32: x2); the fp32
    router probabilities and log-sum-exp stay 4 bytes.
    """
    return _layer_activation_bf16(shape, s, b, tp, sequence_parallel, flash_attention, etp, dtype_bytes / BF16)


def _layer_activation_bf16(shape: LayerShape, s: int, b: int, tp: int, sequence_parallel: bool,
                           flash_attention: bool, etp: int | None, scale: float) -> float:
    h, sb = shape.hidden, s * b
    # Replicated across TP ranks unless sequence parallel splits them (the published "10 sbh").
    shared = 2 * sb * h * 2  # inputs of the two norms (4sbh)
    shared += 2 * sb * h  # QKV projection input (2sbh)
    shared += 2 * sb * h  # MLP / router input (2sbh)
    if shape.dropout:
        shared += 2 * sb * h  # attention and MLP dropout masks (sbh each)
    shared *= scale
    if shape.num_experts:
        shared += FP32 * sb * shape.num_experts  # router probabilities, fp32 (not in the paper: MoE)
    # Split across TP ranks (the published "24 sbh / t" and "5 a s^2 b / t").
    split = 2 * sb * (shape.q_dim + shape.kv_dim)  # Q and K for QK^T (4sbh in MHA)
    split += 2 * sb * shape.kv_dim  # V (2sbh in MHA)
    split += 2 * sb * shape.q_dim  # output projection input (2sbh in MHA)
    if shape.qk_norm:
        split += 2 * sb * (shape.q_dim + shape.kv_dim)  # q/k RMSNorm inputs (Qwen3)
    if not flash_attention:
        split += (5 if shape.dropout else 4) * shape.heads * s * sb  # softmax out (2) [+ mask (1) + dropout out (2)]
    split *= scale
    if flash_attention:
        split += FP32 * shape.heads * sb  # softmax log-sum-exp; no s x s matrix is stored
    split_bytes = split / tp
    if shape.num_experts:
        # Routed copies: with balanced routing a rank of the stage's expert grid holds s*b*k*etp/tp
        # token copies; each keeps its fc1 input (2h) and the SwiGLU input/output (2*2f + 2f)/etp.
        e = tp if etp is None else etp
        copies = sb * shape.mlp_copies * e / tp
        split_bytes += scale * copies * (2 * h + (2 * shape.mlp_act_in + 2 * shape.mlp_act_out) / e)
    else:
        split_bytes += scale * sb * (2 * shape.mlp_act_in + 2 * shape.mlp_act_out) / tp  # GeLU in/out (16sbh)
    return (shared / tp if sequence_parallel else shared) + split_bytes


def recompute_layer_bytes(hidden: int, s: int, b: int, tp: int = 1, sequence_parallel: bool = False,
                          dtype_bytes: int = BF16) -> float:
    """Full recompute keeps only each layer's input: 2sbh (divided by t under sequence parallel)."""
    return dtype_bytes * s * b * hidden / (tp if sequence_parallel else 1)


def logits_bytes(vocab: int, s: int, b: int, tp: int = 1, dtype_bytes: int = BF16,
                 chunk_tokens: int | None = None) -> float:
    """The actor's log-prob stage (megatron/logprobs.py): the LM head's vocab-parallel logits in the
    training dtype (their storage later holds their gradient), the fp32 buffers of one chunk of
    `chunk_tokens` rows the log-softmax works on (y and exp(y)), and per token the fp32 log-prob,
    log-sum-exp, entropy and three row sums plus the int64 label index and whether this rank owns it.
    `vocab` is the padded row count the model is built with (models/vocab.py)."""
    from megatron_sao.megatron.logprobs import DEFAULT_CHUNK_TOKENS, FP32_CHUNK_BUFFERS

    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    per_token_vectors = 6 * FP32 + 8 + 1
    shard = vocab / tp
    return (s * b * shard * dtype_bytes + FP32_CHUNK_BUFFERS * min(chunk, s * b) * shard * FP32
            + s * b * per_token_vectors)


# Megatron-core's RotaryEmbedding.forward is an lru_cache of 32 entries (shared by every model in the
# process), one fp32 [s, 1, 1, head_dim] table per distinct sequence length; micro-batches are as wide
# as their own longest row, so a run meets many lengths and the cache fills up.
ROPE_CACHE_ENTRIES = 32


def rope_cache_bytes(head_dim: int, s: int) -> float:
    """The RoPE tables megatron-core keeps cached: at most ROPE_CACHE_ENTRIES lengths of at most s."""
    return ROPE_CACHE_ENTRIES * s * head_dim * FP32


# Per token of the engine's batch (trainer/step.py::model_inputs plus the targets): tokens, versions and
# turn ids (int64), rollout log-probs, rewards, advantages and returns (fp32), attention, action and
# lag-0 masks (bool).
BATCH_BYTES_PER_TOKEN = 3 * 8 + 4 * FP32 + 3
OUTPUT_BYTES_PER_TOKEN = 2 * FP32  # log-probs / values of the whole batch, and the DP all-gather's buffer


def batch_bytes(rows: int, s: int, dp: int) -> float:
    """What a train step holds of the batch on the device (megatron/engine.py): the whole [rows, s]
    batch copied over, this rank's micro-batches cut from it (about rows/dp of them) and the full
    fp32 outputs gathered back."""
    return rows * s * (BATCH_BYTES_PER_TOKEN + OUTPUT_BYTES_PER_TOKEN) + -(-rows // dp) * s * BATCH_BYTES_PER_TOKEN


# ------------------------------------------------------------------------------- routing replay

INT64 = 8
# int64 [tokens, topk] temporaries of one router's replay at a time (megatron/routing_replay.py: the target's
# conversion, its own top-k, the chosen set, and the sorted copies the agreement counts compare)
REPLAY_TEMPORARIES = 5


def route_id_bytes(num_experts: int) -> int:
    """Bytes of one expert id + 1 in the batch's ``routes`` (trajectory.stack_routes: the smallest integer type)."""
    return 1 if num_experts <= 255 else (2 if num_experts <= 32767 else 4)


def replay_routes_bytes(b: float, s: int, *, layers: int, stage_layers: int, topk: int, num_experts: int,
                        router_tokens: float, held: int) -> float:
    """Routing replay (or rollout.record_routes) on one GPU of the actor, while a forward sets its targets:
    the micro-batch's routes [b, s, layers, topk], moved from the host for that forward, and the int64
    targets of the stage's routers ([router_tokens, topk] each: a TP rank's chunk of the micro-batch under
    SP), kept for ``held`` micro-batches (1; with full recompute the forwards whose backward has not run
    yet: 1F1B's in-flight count), plus one router's temporaries."""
    return (b * s * layers * topk * route_id_bytes(num_experts)
            + (held * stage_layers + REPLAY_TEMPORARIES) * router_tokens * topk * INT64)


def host_routes_bytes(rows: int, s: int, dp: int, *, layers: int, topk: int, num_experts: int) -> float:
    """The batch's routes each trainer rank holds in host memory (they never go to the device whole): the
    [rows, s, layers, topk] batch and this rank's micro-batches cut from it (about rows/dp)."""
    return (rows + -(-rows // dp)) * s * layers * topk * route_id_bytes(num_experts)


# ------------------------------------------------------------------------------- KV cache


def kv_cache_bytes_per_token(spec: ModelSpec, tp: int = 1, dtype_bytes: int = BF16) -> float:
    """Bytes of K and V per token on one GPU of a vLLM server with tensor parallel `tp`.

    vLLM splits KV heads over TP ranks; with more ranks than KV heads each rank keeps one
    (replicated) head, so the per-GPU cost stops shrinking at tp = num_kv_heads.
    """
    heads_per_rank = max(1, spec.num_kv_heads // tp)
    return 2 * spec.num_layers * heads_per_rank * spec.head_dim * dtype_bytes


# ------------------------------------------------------------------------------- colocated phases

# What a vLLM engine keeps on its GPU while asleep: allocations made outside its sleep-mode (CuMem)
# pool (sampler buffers, the CUDA context's share), an assumption like the planner's overhead.
ENGINE_ASLEEP_GIB = 1.0


@dataclass(frozen=True)
class ColocatedPhases:
    """Per-GPU bytes of each phase of a colocated step (rollout/colocate/cycle.py has the order).

    rollout   the engine awake: vLLM's gpu_memory_utilization share (weights, KV cache, its
              activations), the trainer offloaded to host memory
    train     the trainer's peak (weights, grads, optimizer of both models, activations), the engine
              asleep (weights and KV cache released)
    update    the in-process weight load: the actor's parameters (its optimizer and the critic are
              offloaded), the engine's weights, two export buckets and the largest gathered tensor
    """

    rollout: float
    train: float
    update: float
    host_per_gpu: float  # trainer state parked in host memory while the engine is awake

    def worst(self) -> tuple[str, float]:
        return max((("rollout", self.rollout), ("train", self.train), ("update", self.update)), key=lambda x: x[1])


def colocated_phases(*, overhead: float, engine_awake: float, trainer_peak: float, trainer_static: float,
                     actor_param_bytes: float, engine_weights: float, bucket_bytes: float,
                     largest_tensor: float, engine_asleep: float = ENGINE_ASLEEP_GIB * GIB) -> ColocatedPhases:
    """The phases above from their parts; `trainer_peak` and `trainer_static` include `overhead`."""
    return ColocatedPhases(
        rollout=overhead + engine_awake,
        train=trainer_peak + engine_asleep,
        update=overhead + engine_asleep + actor_param_bytes + engine_weights + 2 * bucket_bytes + largest_tensor,
        host_per_gpu=trainer_static - overhead,
    )


def largest_gathered_tensor(spec: ModelSpec, ep: int, param_bytes: int = BF16) -> float:
    """The biggest full tensor the weight export holds at once: the (untied) embedding / LM head, or one
    expert weight all-gathered over the expert-parallel group (ep copies of the fused gate+up matrix)."""
    vocab = spec.vocab_size * spec.hidden_size
    experts = ep * 2 * spec.moe_ffn_hidden_size * spec.hidden_size if spec.is_moe else 0
    return param_bytes * max(vocab, experts)
