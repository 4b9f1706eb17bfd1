"""Ready-made score_mods and mask_mods (common/tile/mods.py has the interface), each a few lines of
Python that fa2 compiles into its forward and backward kernels, and each checked in
tests/test_mods.py against the float64 reference applying the same function. Pass them as

    variants.forward(q, k, v, variant="fa2", score_mod=score_mods.alibi, aux=(slopes,))
    python experiments/run.py variant=fa2 +score_mod=variants.score_mods.alibi ...

Writing one: the arguments are a float32 score (the scaled QK^T), int32 b, h, q_idx, kv_idx and
the call's aux tuple. The function runs once a score, so its cost is counted in instructions a
score; two habits keep it near the built-ins':
- Convert each position to float32 on its own before combining them: `float32(q_idx) -
  float32(kv_idx)` (exact below 2^24), not `float32(q_idx - kv_idx)`. Numba types int32 - int32 as
  int64, which the GPU converts in many instructions; and a row's or a column's conversion is
  shared by every score in it, so the separate form costs one subtraction a score. Where an
  integer difference is needed, wrap it: `int32(q_idx - kv_idx)` compiles to one 32-bit
  subtraction.
- Keep floats float32: `float32(c)` constants (float32 * int64 is float64, half rate or worse).
(docs/performance/score_mods.md measures both forms of ALiBi.)
A score_mod's backward needs score_mod_grad(grad, score, b, h, q_idx, kv_idx, aux) -> grad *
d score_mod / d score: `unchanged_grad` for any score + bias(b, h, q_idx, kv_idx). To learn a
parameter held in aux, add its gradient there with cuda.atomic.add (relative_bias_grad).
"""
import math

import numpy as np
from numba import cuda, float32, int32

from common.tile.mods import unchanged_grad  # noqa: F401  (the grad of every additive bias here)


def alibi(score, b, h, q_idx, kv_idx, aux):
    """ALiBi (Press et al. 2022; flash_attn's alibi_slopes with N_q = N_k): score - slope_h |i - j|,
    aux = (slopes (H,) float32,)."""
    return score - aux[0][h] * abs(float32(q_idx) - float32(kv_idx))


def relative_bias(score, b, h, q_idx, kv_idx, aux):
    """A learned bias by relative position (T5's, with one bucket per distance up to R and the
    rest clamped): score + table[h, clamp(j - i, -R, R) + R], aux = (table (H, 2R + 1) float32,
    and for relative_bias_grad its gradient, same shape, zeroed)."""
    radius = int32((aux[0].shape[1] - 1) // 2)
    return score + aux[0][h, min(max(int32(kv_idx - q_idx), -radius), radius) + radius]


def relative_bias_grad(grad, score, b, h, q_idx, kv_idx, aux):
    """relative_bias's score_mod_grad: the score passes the gradient unchanged, and the table's
    entry takes it too (summed over every score that read it: atomics into aux[1])."""
    radius = int32((aux[0].shape[1] - 1) // 2)
    cuda.atomic.add(aux[1], (h, min(max(int32(kv_idx - q_idx), -radius), radius) + radius), grad)
    return grad


def document_mask(b, h, q_idx, kv_idx, aux):
    """Document masking over a packed sequence: a query sees the keys of its own document,
    aux = (document id of each position (N,) int32,). With causal=True: causal within each."""
    return aux[0][q_idx] == aux[0][kv_idx]


def prefix_lm(b, h, q_idx, kv_idx, aux):
    """Prefix-LM (T5, PaLM's prefix decoder): the first prefix_b keys are seen by every query of
    batch b, the rest causally, aux = (prefix lengths (B,) int32,)."""
    return kv_idx <= q_idx or kv_idx < aux[0][b]


def dilated(b, h, q_idx, kv_idx, aux):
    """A dilated causal mask (Longformer's dilated window, dilation 2): every other key behind the
    query, the query itself included."""
    return kv_idx <= q_idx and int32(q_idx - kv_idx) & 1 == 0


def sliding_window(b, h, q_idx, kv_idx, aux):
    """A causal sliding window of aux[0][0] keys (the query and the keys just before it), as a
    mask_mod: the same keys as causal=True, window_size=(w - 1, 0)."""
    return kv_idx <= q_idx and int32(q_idx - kv_idx) < aux[0][0]


def tanh_softcap(score, b, h, q_idx, kv_idx, aux):
    """Gemma 2's soft cap of 30 as a score_mod (the built-in: softcap=30.0)."""
    return float32(30) * math.tanh(score / float32(30))


def tanh_softcap_grad(grad, score, b, h, q_idx, kv_idx, aux):
    """tanh_softcap's score_mod_grad: grad (1 - tanh^2(score / 30))."""
    t = math.tanh(score / float32(30))
    return grad * (float32(1) - t * t)


def compile_example():
    """What the compile report compiles into fa2's and fa3's forward to check a kernel with mods
    (experiments/compile_report.py; registers, spills, serialised wgmmas): ALiBi as a score_mod
    and a document mask as a mask_mod, their ScoreMods and the Numba type of their aux."""
    from numba import types

    from common.host.mods import resolve
    aux = types.Tuple((types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C")))
    return resolve(score_mod=alibi, mask_mod=document_mask_beside_slopes), (aux,)


def document_mask_beside_slopes(b, h, q_idx, kv_idx, aux):
    """document_mask with its ids in aux[1], so that it runs beside `alibi` (slopes in aux[0])
    on one aux tuple."""
    return aux[1][q_idx] == aux[1][kv_idx]


# aux factories for the examples above: (rng, batch, heads, n_q, n_k) -> a tuple of host arrays
# (the Hydra app's `problem.aux`, the tests' inputs)

def alibi_aux(rng, batch, heads, n_q, n_k):
    """ALiBi's slopes as its paper sets them, 2^(-8 h / H) for heads h = 1..H."""
    return ((2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32),)


def relative_bias_aux(rng, batch, heads, n_q, n_k, radius=8):
    """A random (H, 2R + 1) bias table and its zeroed gradient."""
    table = rng.uniform(-2, 2, (heads, 2 * radius + 1)).astype(np.float32)
    return table, np.zeros_like(table)


def document_aux(rng, batch, heads, n_q, n_k, documents=3):
    """Document ids of the n_k positions: `documents` documents of random lengths."""
    cuts = np.sort(rng.choice(np.arange(1, n_k), documents - 1, replace=False))
    return (np.repeat(np.arange(documents), np.diff(np.concatenate([[0], cuts, [n_k]])))
            .astype(np.int32),)


def prefix_aux(rng, batch, heads, n_q, n_k):
    """A random prefix length a batch, 1 .. N_k / 2."""
    return (rng.integers(1, max(2, n_k // 2), batch).astype(np.int32),)


def window_aux(rng, batch, heads, n_q, n_k):
    """A window of N_k / 4 keys."""
    return (np.array([max(1, n_k // 4)], np.int32),)
