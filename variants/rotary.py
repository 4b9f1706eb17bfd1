"""Rotary position embeddings (RoPE: Su et al. 2021) applied inside a KV-cache call, as
flash_attn_with_kvcache's `rotary_cos` / `rotary_sin` / `rotary_interleaved` do:

    x[..., j], x[..., j'] <- x_j cos(p θ_j) - x_j' sin(p θ_j),  x_j' cos(p θ_j) + x_j sin(p θ_j)

for the first rotary_dim = 2 * cos.shape[1] columns of each head (the rest unchanged), with
cos[p, j] = cos(p θ_j) and sin[p, j] given per position p (seqlen_ro, rotary_dim / 2) in the
inputs' 16-bit type. Pairs: (2j, 2j + 1) when interleaved (GPT-J), (j, j + rotary_dim / 2) when not
(GPT-NeoX). Positions, as flash_attn's: the appended keys k at cache_seqlens[b] + t; the queries
at cache_seqlens[b] + i when causal or windowed, else all at cache_seqlens[b].

One small kernel over the new tokens (q, and k before the append): a thread an output element,
fp32 arithmetic, rounded once to the 16-bit type, as flash_attn's. The split kernel then reads the
rotated q and the cache holds the rotated keys. (flash_attn fuses the rotation into its kernels;
here it is one launch more a call, on a few rows.)"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from common.host import arrays
from common.host.launching import launch
from common.hardware.target import device_function, kernel
from common.tile import tiles

THREADS = 128


@lru_cache(maxsize=None)
def build(interleaved, element):
    """The rotation kernel for one pairing and 16-bit type (element: common/hardware/elements)."""
    ELEM = element.code

    @device_function
    def load(bits):
        return tiles.unpack_pair(uint32(bits), ELEM)[0]

    @kernel
    def rotary(x, out, cos, sin, cache_seqlens, per_token):
        """x, out (B, N, H, d) uint16; cos, sin (seqlen_ro, rotary_dim / 2) uint16; token i of
        sequence b at position cache_seqlens[b] + (i if per_token else 0), clamped into the
        table (an unchecked call never reads outside it)."""
        i, b = int32(cuda.blockIdx.x), int32(cuda.blockIdx.y)
        heads, d, half = int32(x.shape[2]), int32(x.shape[3]), int32(cos.shape[1])
        pos = int32(cache_seqlens[b]) + (i if per_token != 0 else int32(0))
        pos = min(max(pos, int32(0)), int32(cos.shape[0] - 1))
        for e in range(int32(cuda.threadIdx.x), heads * d, THREADS):
            h = e // d
            c = e - h * d
            if c >= 2 * half:
                out[b, i, h, c] = x[b, i, h, c]
                continue
            if interleaved:
                j, partner, first = c >> 1, c ^ 1, (c & 1) == 0
            else:
                first = c < half
                j = c if first else c - half
                partner = c + half if first else c - half
            own, other = load(x[b, i, h, c]), load(x[b, i, h, partner])
            co, si = load(cos[pos, j]), load(sin[pos, j])
            value = own * co - other * si if first else own * co + other * si
            out[b, i, h, c] = uint16(tiles.pack_pair(value, float32(0), ELEM) & uint32(0xFFFF))

    return rotary


def check_tables(rotary_cos, rotary_sin, head_dim, dtype):
    """The described cos and sin tables, or the error naming what is wrong with them."""
    dc, ds = arrays.describe(rotary_cos, "rotary_cos"), arrays.describe(rotary_sin, "rotary_sin")
    if dc.shape != ds.shape or len(dc.shape) != 2:
        raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got "
                         f"{dc.shape} and {ds.shape}")
    rotary_dim = 2 * dc.shape[1]
    if rotary_dim % 16 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be a multiple "
                         f"of 16 from 16 to head_dim {head_dim}")
    if dc.dtype != dtype or ds.dtype != dtype:
        raise TypeError(f"rotary_cos and rotary_sin must have q's dtype {dtype}, got {dc.dtype} "
                        f"and {ds.dtype}")
    if dc.shape[0] < 1:
        raise ValueError("rotary_cos holds no position")
    return dc, ds


def rotated(view, tables, cache_seqlens, per_token, interleaved, element, prob):
    """A new (B, N, H, d) array of `prob`'s library holding `view` (a kernel view of the same
    shape) rotated, and its kernel view."""
    dc, ds = tables
    shape = tuple(view.shape)
    out, out_view = arrays.empty_with_view(prob.library, shape, prob.dtype, np.uint16, prob.like)
    if shape[0] and shape[1]:
        launch(build(bool(interleaved), element), (shape[1], shape[0]), THREADS, 0, prob.stream,
               view, out_view, arrays.bits_view(dc, np.uint16), arrays.bits_view(ds, np.uint16),
               cache_seqlens, np.int32(1 if per_token else 0))
    return out, out_view
