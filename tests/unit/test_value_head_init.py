"""A fresh critic must not start with an explained variance far below 0 (issue 35).

On SmolLM2-135M the final-norm hidden states have a norm of about 54, and a value head drawn from
N(0, 0.02) turned them into values with a std near 1, four times the return's: EV -2.9 to -5.5 at
step 0 of every run. The zero head (the default) starts as a constant: EV 0.
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_sao.algorithms import explained_variance
from megatron_sao.config import load_config
from megatron_sao.models.value_head import ValueHead

HIDDEN = 576  # SmolLM2-135M


def _hidden_states(seq: int, batch: int, norm: float = 54.0) -> torch.Tensor:
    """[S, B, H] states of norm ~`norm` with a shared direction, as final-norm outputs have."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(HIDDEN, generator=g)
    h = 0.8 * shared + torch.randn(seq, batch, HIDDEN, generator=g)
    return h / h.norm(dim=-1, keepdim=True) * norm


def _ev_at_step0(init: str) -> float:
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=9, init_method_std=0.02)
    head = ValueHead(cfg, init=init)
    h = _hidden_states(64, 16)
    g = torch.Generator().manual_seed(1)
    success = (torch.rand(16, generator=g) < 0.35).float()  # 0/1 returns, one per trajectory
    returns = success[None, :].expand(64, 16)
    with torch.no_grad():
        values = head(h)[0].squeeze(-1)
    assert torch.allclose(h.norm(dim=-1), torch.full((64, 16), 54.0), rtol=1e-4)
    mask = torch.ones(16, 64, dtype=torch.bool)
    return float(explained_variance(values.T.contiguous(), returns.T.contiguous(), mask))


def test_a_fresh_zero_head_explains_nothing_and_no_less():
    assert abs(_ev_at_step0("zero")) < 1e-6


def test_the_normal_head_starts_far_below_zero_on_states_of_norm_54():
    assert _ev_at_step0("normal") < -1.0


def test_the_config_default_is_the_zero_head_with_the_mean_return_bias():
    c = load_config(None).critic
    assert (c.value_head_init, c.value_head_bias, c.value_head_lr) == ("zero", "mean_return", None)
