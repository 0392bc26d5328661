"""Core attention for the local (non-TransformerEngine) layer spec through torch's fused kernel.

Megatron's local `DotProductAttention` spells attention out: the key/value heads repeated to the query
heads (a copy), Q K^T by `baddbmm` into a [b * heads, s, s] score buffer, a causal mask built and
applied by `masked_fill`, softmax, then `bmm` with V and a permuted copy of the context. Its backward
keeps the [b * heads, s, s] probabilities. `torch.nn.functional.scaled_dot_product_attention` with
`is_causal=True` does the same product in one fused kernel (flash attention on a CPU: tiled, the
causal mask implicit, grouped-query heads read in place), which is what a plain PyTorch or HF model
runs. Same math; the results differ by rounding (about 1e-6 on fp32 logits).

The fused path covers what the trainer builds: self-attention over the whole sequence (as many queries
as keys), a causal mask given by type (no mask tensor,
`megatron/forward.py::model_inputs`), no window, the vanilla softmax, no attention dropout, no
query-key layer scaling. Anything else goes through Megatron's own forward unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """`DotProductAttention` (same constructor, parameters and state) whose causal, mask-free forward is
    one `scaled_dot_product_attention` call."""

    def _fused(self, query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        c = self.config
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return (query.shape[0] == key.shape[0] and attention_mask is None and mask_type == AttnMaskType.causal
                and attention_bias is None and packed_seq_params is None and c.window_size is None
                and self.softmax_offset is None and not c.apply_query_key_layer_scaling
                and (self.attention_dropout.p == 0.0 or not self.training))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused(query, key, attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]: views; the kernel reads the strides it is given
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        # [b, heads, s, d] -> [s, b, heads * d], the layout linear_proj takes
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)
