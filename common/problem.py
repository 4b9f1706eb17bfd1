"""One attention call, checked and laid out for the kernels: every variant's `forward` starts here.

`prepare` validates q, k, v (and optional preallocated outputs) with errors that name the problem,
and returns the zero-copy views the kernels take:
  q, k, v  (B, H, N, d) uint16          o32  (B, H, N_q, d/2) uint32 over the output
  lse      (B, H, N_q) float32
"""
import math
from dataclasses import dataclass

import numpy as np
from numba import types

from common import arrays

_BSHD_TO_BHSD = (0, 2, 1, 3)   # flash_attn_func layout (batch, seq, heads, dim) -> (batch, heads, seq, dim)

# Numba types of the views `prepare` makes (what kernels are specialised on), for compiling kernels
# ahead of time on machines without a GPU (tests/test_compile.py).
QKV_TYPE = types.Array(types.uint16, 4, "A")      # q, k, v: (B, H, N, d) permuted views
OUT_TYPE = types.Array(types.uint32, 4, "A")      # o32: (B, H, N_q, d/2) permuted view
LSE_TYPE = types.Array(types.float32, 3, "C")     # lse: (B, H, N_q)


@dataclass
class AttentionProblem:
    batch: int
    heads: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str
    causal: bool
    softmax_scale: float
    q: object
    k: object
    v: object
    o32: object
    lse: object
    o_out: object
    lse_out: object
    library: str
    stream: object
    like: object

    @property
    def is_bf16(self):
        return self.dtype == "bfloat16"

    @property
    def kv_group(self):
        return self.heads // self.heads_kv

    def result(self):
        return self.o_out, self.lse_out

    def scratch(self, shape, dtype):
        """A work array in the caller's library (so its memory pool serves it)."""
        return arrays.empty(self.library, shape, dtype, like=self.like)


def prepare(q, k, v, *, causal, softmax_scale, out, head_dims, variant):
    dq, dk, dv = (arrays.describe(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    for d, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        if len(d.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim) as in "
                             f"flash_attn_func, got shape {d.shape}")
        if d.dtype not in ("float16", "bfloat16"):
            raise TypeError(f"{name} has dtype {d.dtype}; {variant} takes float16 or bfloat16")
    if not dq.dtype == dk.dtype == dv.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {dq.dtype}, {dk.dtype}, {dv.dtype}")
    if len({dq.library, dk.library, dv.library}) != 1:
        raise TypeError(f"q, k, v come from different array libraries "
                        f"({dq.library}, {dk.library}, {dv.library})")
    (b, n_q, h, d), (bk, n_k, h_kv, dk_) = dq.shape, dk.shape
    if dk.shape != dv.shape:
        raise ValueError(f"k and v must have the same shape, got {dk.shape} and {dv.shape}")
    if bk != b:
        raise ValueError(f"q has batch {b} but k, v have batch {bk}")
    if dk_ != d:
        raise ValueError(f"q has head_dim {d} but k, v have head_dim {dk_}")
    if min(b, n_q, h, n_k, h_kv) < 1:
        raise ValueError(f"empty problem: q {dq.shape}, k {dk.shape}")
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of the {h_kv} heads of k, v")
    if d not in head_dims:
        raise ValueError(f"{variant} supports head_dim in {tuple(head_dims)}, got {d}")
    if causal and n_q != n_k:
        raise ValueError(f"causal=True needs seqlen_q == seqlen_k (got {n_q} and {n_k}): the "
                         "diagonal of a rectangular mask is ambiguous (top-left or bottom-right)")
    if max(b, h) > 65535:
        raise ValueError(f"batch and heads must each be at most 65535, got {b} and {h}")
    for x, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        _check_layout(x, name)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")

    if out is None:
        o_out = arrays.empty(dq.library, (b, n_q, h, d), dq.dtype, like=q)
        lse_out = arrays.empty(dq.library, (b, h, n_q), "float32", like=q)
    else:
        o_out, lse_out = out
    do, dl = arrays.describe(o_out, "out[0] (o)"), arrays.describe(lse_out, "out[1] (lse)")
    if do.shape != dq.shape or do.dtype != dq.dtype:
        raise ValueError(f"out[0] must be {dq.dtype} of shape {dq.shape}, got {do.dtype} {do.shape}")
    if dl.shape != (b, h, n_q) or dl.dtype != "float32":
        raise ValueError(f"out[1] must be float32 of shape {(b, h, n_q)}, got {dl.dtype} {dl.shape}")
    _check_layout(do, "out[0] (o)")
    if dl.strides[-1] != 4:
        raise ValueError("out[1] (lse) must be contiguous along its last axis")

    return AttentionProblem(
        batch=b, heads=h, heads_kv=h_kv, n_q=n_q, n_k=n_k, head_dim=d, dtype=dq.dtype,
        causal=bool(causal), softmax_scale=softmax_scale,
        q=arrays.bits_view(dq, np.uint16, _BSHD_TO_BHSD),
        k=arrays.bits_view(dk, np.uint16, _BSHD_TO_BHSD),
        v=arrays.bits_view(dv, np.uint16, _BSHD_TO_BHSD),
        o32=arrays.bits_view(do, np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2),
        lse=arrays.bits_view(dl, np.float32),
        o_out=o_out, lse_out=lse_out, library=dq.library, stream=arrays.stream_of(dq), like=q)


def _check_layout(d, name):
    """The kernels move 16-byte chunks of rows: the head_dim axis must be contiguous and every
    row start 16-byte aligned."""
    if d.strides[3] != d.itemsize:
        raise ValueError(f"{name} must be contiguous along head_dim (stride {d.strides[3]} bytes); "
                         "make it contiguous first")
    if any(s % 16 for s, n in zip(d.strides[:3], d.shape[:3]) if n > 1) or d.ptr % 16:
        raise ValueError(f"{name} rows must start at 16-byte boundaries (strides {d.strides} bytes, "
                         f"address {d.ptr:#x}); make it contiguous first")
