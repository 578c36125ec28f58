"""Attention processors for `Kandinsky6SRTransformer3DModel`.

The stock processor always calls flex attention with a NABLA block mask built with `mask_mod=None`. Uncompiled, flex
ignores the block lists and computes dense attention by materialising the whole score matrix (~254 GB per tensor for
one full-size tile). `DenseSDPAProcessor` computes that same dense attention with `scaled_dot_product_attention`,
which picks a fused kernel (flash / cuDNN / memory-efficient) and never builds the matrix: it is exact and the
default. `NablaFlexProcessor` is the trained sparse attention (NABLA) for a compiled transformer: faster by its
sparsity, but not the same numbers as dense attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from worker.sr.k6_models import transformer as k6_transformer

apply_rotary, nabla_block_mask = k6_transformer.apply_rotary, k6_transformer.nabla_block_mask

# Flex attention's tiles must divide NABLA's 64-token blocks; diffusers pins only BLOCK_M, with which the compiled
# kernel fails to build on Hopper (torch 2.11): both at 64 build and run.
NABLA_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64}


def qkv(attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, H, S, D) query, key and value as the stock processor makes them (fp32 RMSNorm, then RoPE)."""
    query = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
    key = attn.to_key(hidden_states).unflatten(-1, (attn.num_heads, -1))
    value = attn.to_value(hidden_states).unflatten(-1, (attn.num_heads, -1))
    query = apply_rotary(attn.query_norm(query.float()).type_as(query), rotary_emb)
    key = apply_rotary(attn.key_norm(key.float()).type_as(key), rotary_emb)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _out(attn: Any, out: torch.Tensor) -> torch.Tensor:
    return attn.out_layer(out.transpose(1, 2).flatten(2, 3))  # (B, H, S, D) -> (B, S, H * D)


class DenseSDPAProcessor:
    """Dense self-attention on the same q/k/v as the stock processor."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: Any) -> torch.Tensor:
        query, key, value = qkv(attn, hidden_states, rotary_emb)
        return _out(attn, F.scaled_dot_product_attention(query, key, value))


class NablaFlexProcessor:
    """NABLA sparse attention, as the checkpoint was trained: the stock block mask, flex attention with tiles that
    build on Hopper. Only for a compiled transformer (eager flex materialises the scores)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: Any) -> torch.Tensor:
        query, key, value = qkv(attn, hidden_states, rotary_emb)
        mask = nabla_block_mask(query, key, sparse_params["sta_mask"], thr=sparse_params["threshold"])
        return _out(attn, flex_attention(query, key, value, block_mask=mask, kernel_options=NABLA_KERNEL_OPTIONS))


def nabla_density(query: torch.Tensor, key: torch.Tensor, sparse_params: Any) -> torch.Tensor:
    """The fraction of (query block, key block) pairs NABLA keeps for these (B, H, S, D) queries and keys."""
    mask = nabla_block_mask(query, key, sparse_params["sta_mask"], thr=sparse_params["threshold"])
    blocks = mask.full_kv_num_blocks  # NABLA keeps whole blocks: they are all "full" ones
    return blocks.sum() / (blocks.numel() * mask.full_kv_indices.shape[-1])


PROCESSORS = {"sdpa": DenseSDPAProcessor, "nabla": NablaFlexProcessor}
