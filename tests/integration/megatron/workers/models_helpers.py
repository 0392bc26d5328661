"""Shared pieces of the model worker scripts (run under torchrun, gloo, CPU)."""

from __future__ import annotations

import json

import torch

from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

ensure_cpu_compat()
torch.set_num_threads(1)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_sao.checkpoint.sharding import RankLayout  # noqa: E402

MBS, SEQ = 2, 16


def init_dist() -> tuple[int, int]:
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> RankLayout:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(123, inference_rng_tracker=True)
    return RankLayout.from_parallel_state()


def batch(vocab: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (MBS, SEQ), generator=g)
    labels = torch.randint(0, vocab, (MBS, SEQ), generator=g)
    pos = torch.arange(SEQ)[None].expand(MBS, SEQ).contiguous()
    return tokens, labels, pos


def forward_only(model, tokens, pos):
    """Forward through Megatron's pipeline schedule; the last stage gets the model output."""
    mask = None  # causal by mask type (AttnMaskType.causal), as the engine runs it

    def step(it, m):
        next(it)
        return m(tokens, pos, mask), (lambda out, non_loss_data=False: out)

    out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([0]), model=[model],
                                      num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS, forward_only=True,
                                      collect_non_loss_data=True)
    return out[0].float() if parallel_state.is_pipeline_last_stage() else None


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)
