"""The attention variants, one module each, behind one API.

    from variants import forward
    o, lse = forward(q, k, v, variant="fa2", causal=True)

q: (batch, seqlen_q, heads, head_dim), k and v: (batch, seqlen_k, heads_kv, head_dim), as in
flash_attn_func; fp16 or bf16 CuPy arrays, Numba device arrays or torch CUDA tensors (no copies).
Returns o like q and lse (batch, heads, seqlen_q) float32, the log-sum-exp of each row's scores.
The mask is flash_attn_func's: `causal`, `window_size=(left, right)` (-1: unbounded), `softcap`
(Gemma 2's tanh capping), and, beyond flash_attn, `align="top_left"` for torch's `is_causal`
diagonal instead of the bottom-right one (common/tile/masks.py). A row that sees no key gets O = 0 and
LSE = -inf.

    o, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
runs a packed batch of sequences of different lengths (flash_attn_varlen_func; every variant), and
    dq, dk, dv = backward(do, q, k, v, o, lse, variant="fa2", causal=True)

is the backward pass (recomputing P from lse, nothing N x N stored except by `standard`), and
`attention(q, k, v, variant=..., causal=...)` (variants/autograd.py) the same two as a
torch.autograd.Function for torch CUDA tensors.

    o, lse = decode(q, k_cache, v_cache, cache_seqlens, block_table=..., k=..., v=...)

attends a few new tokens to a (paged) KV cache, split over the keys (Flash-Decoding,
variants/decoding.py; flash_attn_with_kvcache's conventions).
"""
from variants.registry import (REGISTRY, backward, backward_varlen, forward, forward_varlen,  # noqa: F401
                               get)


def attention(q, k, v, *, variant="fa2", causal=False, softmax_scale=None, **options):
    """Differentiable attention for torch tensors (variants/autograd.py)."""
    from variants.autograd import attention as autograd_attention
    return autograd_attention(q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
                              **options)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     variant="fa2", causal=False, softmax_scale=None, **options):
    """Differentiable attention over a packed batch, as flash_attn_varlen_func (autograd.py)."""
    from variants.autograd import attention_varlen as autograd_attention_varlen
    return autograd_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, variant=variant, causal=causal,
                                     softmax_scale=softmax_scale, **options)


def decode(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, causal=False,
           softmax_scale=None, num_splits=0, split_kv=True, **options):
    """Attention of a few new tokens (q: (B, N_q, H, d)) against each sequence's KV cache, as
    flash_attn_with_kvcache: caches (B, N_max, H_kv, d), or paged (num_pages, page_size, H_kv, d)
    with block_table (B, max_blocks) int32; cache_seqlens (B,) int32; k, v (B, N_new, H_kv, d)
    appended first. Split-KV (Flash-Decoding; variants/decoding.py). options: flash_attn's
    cache_leftpad, cache_batch_idx, window_size, softcap, alibi_slopes, rotary_cos / rotary_sin /
    rotary_interleaved, and decoding.decode's own (check, out, the Config's). Returns (o like q,
    lse)."""
    from variants.decoding import decode as split_kv_decode
    return split_kv_decode(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                           causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                           split_kv=split_kv, **options)


def block_mask(mask_mod, n_q, n_k, *, batch=1, heads=1, aux=(), like=None):
    """A mask_mod's block structure for one geometry (FlexAttention's create_block_mask): pass it
    as `block_mask=` beside the same mask_mod, and fa2's forward visits only the key blocks that
    hold a kept element, testing no element of the blocks kept whole. batch, heads: those the
    mask varies over (1: the same for all). Made on the GPU at its first use, then reused
    (common/host/mods.py BlockMask, docs/score_mods.md)."""
    from common.host.mods import BlockMask
    return BlockMask(mask_mod, n_q, n_k, batch=batch, heads=heads, aux=aux, like=like)

