"""Attention processors for `Kandinsky6SRTransformer3DModel`.

The stock processor always calls flex attention with a NABLA block mask built with `mask_mod=None`. Uncompiled, flex
ignores the block lists and computes dense attention by materialising the whole score matrix (~254 GB per tensor for
one full-size tile). `DenseSDPAProcessor` computes that same dense attention with `scaled_dot_product_attention`,
which picks a fused kernel (flash / cuDNN / memory-efficient) and never builds the matrix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_kandinsky6_sr import apply_rotary


class DenseSDPAProcessor:
    """Dense self-attention on the same q/k/v as the stock processor (fp32 RMSNorm, then RoPE)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: Any) -> torch.Tensor:
        query = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
        key = attn.to_key(hidden_states).unflatten(-1, (attn.num_heads, -1))
        value = attn.to_value(hidden_states).unflatten(-1, (attn.num_heads, -1))
        query = apply_rotary(attn.query_norm(query.float()).type_as(query), rotary_emb)
        key = apply_rotary(attn.key_norm(key.float()).type_as(key), rotary_emb)
        # (B, S, H, D) -> (B, H, S, D) for SDPA, and back.
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return attn.out_layer(out.transpose(1, 2).flatten(2, 3))


PROCESSORS = {"sdpa": DenseSDPAProcessor}
