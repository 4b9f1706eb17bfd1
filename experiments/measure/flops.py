"""The FLOP count every speed figure uses (the FlashAttention papers' convention)."""
import numpy as np


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False, mode="fwd",
                    pairs=None):
    """4 * B * H * N_q * N_k * d for the forward (two matmuls of 2 N_q N_k d each), halved when
    causal; the backward counts 2.5x the forward (five matmuls), fwd_bwd 3.5x. pairs: the
    (query, key) pairs a head computes instead of N_q * N_k (or half of it), for the masks that
    are not square causal (`visible_pairs`)."""
    if pairs is None:
        pairs = seqlen_q * seqlen_k // (2 if causal else 1)
    fwd = 4 * batch * heads * pairs * head_dim
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def visible_pairs(n_q, n_k, band):
    """How many (query, key) pairs fall inside a common.tile.masks.Band: sum over the rows r of the
    keys max(0, r + lo) .. min(N_k - 1, r + hi)."""
    r = np.arange(n_q, dtype=np.int64)
    first = np.maximum(r + band.lo, 0)
    last = np.minimum(r + band.hi, n_k - 1)
    return int(np.maximum(last - first + 1, 0).sum())
