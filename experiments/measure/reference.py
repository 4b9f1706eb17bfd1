"""Exact attention in float64 NumPy: the answer every variant is checked against.

    S = softmax_scale * Q K^T,  softcap: S <- softcap * tanh(S / softcap),
    S[i, j] = -inf where key j is outside query i's band (causal, window_size: common/tile/masks.py),
    LSE[i] = log sum_j exp(S[i, j]),  O = exp(S - LSE) V.

Layouts are flash_attn_func's: q (B, N_q, H, d), k and v (B, N_k, H_kv, d) with H a multiple of
H_kv (grouped-query attention: query head h reads K/V head h // (H / H_kv)). Returns O (B, N_q, H, d)
and LSE (B, H, N_q). A row with every score masked gets O = 0 and LSE = -inf.
"""
import math

import numpy as np

from common.tile import masks


def visible(rows, n_k, causal, window_size, align, n_q):
    """Boolean (len(rows), N_k): which keys each query row sees, written from the definition in
    common/tile/masks.py (not from its band arithmetic, which this checks)."""
    left, right = window_size
    shift = n_k - n_q if align == masks.BOTTOM_RIGHT else 0
    c = np.arange(n_k)[None, :]
    r = np.asarray(rows)[:, None] + shift           # the query's diagonal position among the keys
    ok = np.ones((len(rows), n_k), dtype=bool)
    if causal:
        ok &= c <= r
    if left >= 0:
        ok &= c >= r - left
    if right >= 0:
        ok &= c <= r + right
    return ok


def attention(q, k, v, *, causal=False, softmax_scale=None, rows=None, window_size=(-1, -1),
              softcap=0.0, align=masks.BOTTOM_RIGHT):
    """float64 attention. `rows` (optional int array) restricts the output to those query rows,
    which makes checking long sequences cheap: each row's result is exact on its own."""
    b, n_q, h, d = q.shape
    h_kv = k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    rows = np.arange(n_q) if rows is None else np.asarray(rows)
    group = h // h_kv
    qh = np.asarray(q, dtype=np.float64)[:, rows].transpose(0, 2, 1, 3)          # (B, H, r, d)
    kh = np.repeat(np.asarray(k, dtype=np.float64), group, axis=2).transpose(0, 2, 3, 1)  # (B, H, d, N_k)
    vh = np.repeat(np.asarray(v, dtype=np.float64), group, axis=2).transpose(0, 2, 1, 3)  # (B, H, N_k, d)
    ok = visible(rows, k.shape[1], causal, window_size, align, n_q)
    p, lse, _ = softmax_rows(qh @ kh, ok, softmax_scale, softcap)
    return (p @ vh).transpose(0, 2, 1, 3), lse


def softmax_rows(qk, ok, softmax_scale, softcap=0.0):
    """P = softmax(S) of S = softmax_scale * QK^T (soft-capped if softcap > 0), its log-sum-exp,
    and dS_capped/dS (1 where there is no cap); `ok` marks the scores that count (others are
    masked). A row with every score masked gets P = 0 and LSE = -inf."""
    s = qk * softmax_scale
    cap_grad = np.ones_like(s)
    if softcap:
        t = np.tanh(s / softcap)
        s, cap_grad = softcap * t, 1 - t * t
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (m + np.log(l))[..., 0]
        p = np.where(l > 0, e / l, 0.0)
    return p, lse, cap_grad


def attention_backward(q, k, v, do, *, causal=False, softmax_scale=None, block_rows=1024,
                       window_size=(-1, -1), softcap=0.0, align=masks.BOTTOM_RIGHT):
    """float64 gradients (dq, dk, dv) of sum(O * dO) for O = attention(q, k, v): with P the
    softmax, dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(dO o O)) (times 1 - tanh^2 with a
    softcap), dQ = scale dS K, dK = scale dS^T Q; K/V heads shared by a group of query heads sum
    the group's gradients.
    Every row's P, dP and dS depend on that row alone, so rows are taken `block_rows` at a time
    (memory: block_rows x N_k per head, not N_q x N_k)."""
    b, n_q, h, d = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    group = h // h_kv
    qh = np.asarray(q, dtype=np.float64).transpose(0, 2, 1, 3)                      # (B, H, N_q, d)
    kh = np.repeat(np.asarray(k, dtype=np.float64), group, axis=2).transpose(0, 2, 1, 3)
    vh = np.repeat(np.asarray(v, dtype=np.float64), group, axis=2).transpose(0, 2, 1, 3)
    doh = np.asarray(do, dtype=np.float64).transpose(0, 2, 1, 3)
    dq = np.zeros_like(qh)
    dk = np.zeros_like(kh)
    dv = np.zeros_like(vh)
    for r0 in range(0, n_q, block_rows):
        rows = np.arange(r0, min(n_q, r0 + block_rows))
        qb, dob = qh[:, :, rows], doh[:, :, rows]
        ok = visible(rows, n_k, causal, window_size, align, n_q)
        p, _, cap_grad = softmax_rows(qb @ kh.transpose(0, 1, 3, 2), ok, softmax_scale, softcap)
        ob = p @ vh
        dv += p.transpose(0, 1, 3, 2) @ dob
        ds = p * (dob @ vh.transpose(0, 1, 3, 2) - (dob * ob).sum(axis=-1, keepdims=True))
        ds = ds * cap_grad
        dq[:, :, rows] = softmax_scale * ds @ kh
        dk += softmax_scale * ds.transpose(0, 1, 3, 2) @ qb

    def per_kv_head(x):      # (B, H, N_k, d) -> (B, N_k, H_kv, d), summed over each group
        return x.reshape(b, h_kv, group, n_k, d).sum(axis=2).transpose(0, 2, 1, 3)

    return dq.transpose(0, 2, 1, 3), per_kv_head(dk), per_kv_head(dv)
