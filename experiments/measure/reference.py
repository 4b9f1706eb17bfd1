"""Exact attention in float64 NumPy: the answer every variant is checked against.

    S = softmax_scale * Q K^T,  softcap: S <- softcap * tanh(S / softcap),
    ALiBi (alibi_slopes, (H,) or (B, H)): S[i, j] <- S[i, j] - slope |i + shift - j| (shift as the
    band's: N_k - N_q bottom-right, 0 top-left; flash_attn's alibi_slopes),
    S[i, j] = -inf where key j is outside query i's band (causal, window_size: common/tile/masks.py),
    sinks ((H,), gpt-oss's learnable attention sinks): a logit s_h of no value joining each row's
    normaliser,
    LSE[i] = log sum_j exp(S[i, j])  (+ exp(s_h) with sinks),  O = exp(S - LSE) V,
    dropout (dropout_p, dropout_mask Z (B, H, N_q, N_k) bool): O = (Z o P / (1 - p)) V, LSE as
    without (common/tile/dropout.py's keep_mask gives the kernels' Z),
    score_mod(score, b, h, q_idx, kv_idx, aux) and mask_mod(b, h, q_idx, kv_idx, aux) (common/tile/
    mods.py; aux: host arrays): S[i, j] <- score_mod(S[i, j], ...) after the cap and ALiBi, -inf
    where mask_mod is False; the backward differentiates score_mod by central differences in
    float64 (independently of the kernels' score_mod_grad, which it so checks).

Layouts are flash_attn_func's: q (B, N_q, H, d), k and v (B, N_k, H_kv, d) with H a multiple of
H_kv (grouped-query attention: query head h reads K/V head h // (H / H_kv)). Returns O (B, N_q, H, d)
and LSE (B, H, N_q). A row with every score masked gets O = 0 and LSE = -inf.
"""
import math

import numpy as np

from common.tile import masks


def visible(rows, n_k, causal, window_size, align, n_q, attention_chunk=0):
    """Boolean (len(rows), N_k): which keys each query row sees, written from the definition in
    common/tile/masks.py (not from its band arithmetic, which this checks); attention_chunk = C
    (FA3's, Llama 4's chunked attention): only the keys of the query's C-key chunk
    (variants/flash_attn.py: _chunked)."""
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
    if attention_chunk:
        ok &= (c // attention_chunk) == (r // attention_chunk)
    return ok


def alibi_bias(slopes, batch, heads, rows, n_k, n_q, align):
    """-slope |r + shift - c| as (B, H, len(rows), N_k) float64, or 0 without slopes."""
    if slopes is None:
        return 0.0
    slopes = np.broadcast_to(np.asarray(slopes, dtype=np.float64).reshape(-1, heads)
                             if np.ndim(slopes) == 2 else np.asarray(slopes, np.float64)[None],
                             (batch, heads))
    shift = n_k - n_q if align == masks.BOTTOM_RIGHT else 0
    dist = np.abs(np.asarray(rows)[:, None] + shift - np.arange(n_k)[None, :])
    return -slopes[:, :, None, None] * dist[None, None]


def modded(score_mod=None, mask_mod=None, aux=(), batch_offset=0):
    """mod(s, rows) -> (s', keep, d s'/d s) for softmax_rows, applying a user's score_mod and
    mask_mod to scaled scores s (B, H, len(rows), N_k) in float64, or None without either. The
    functions are called once on whole index grids (NumPy broadcasting) when they allow it, else
    element by element. b counts from batch_offset (a packed batch's sequence checked alone)."""
    if score_mod is None and mask_mod is None:
        return None
    aux = tuple(np.asarray(a) for a in aux)

    def call(fn, *args):
        shape = np.broadcast_shapes(*(np.shape(a) for a in args))
        try:   # a function of fewer indices (a document mask: q_idx, kv_idx) broadcasts
            return np.broadcast_to(np.asarray(fn(*args, aux), dtype=np.float64), shape)
        except Exception:
            pass
        vec = np.vectorize(lambda *x: float(fn(*x, aux)), otypes=[np.float64])
        return vec(*args)

    def mod(s, rows):
        b, h, _, n_k = s.shape
        bi = np.arange(b)[:, None, None, None] + batch_offset
        hi = np.arange(h)[None, :, None, None]
        qi = np.asarray(rows)[None, None, :, None]
        ki = np.arange(n_k)[None, None, None, :]
        grad = np.ones_like(s)
        if score_mod is not None:
            fn = getattr(score_mod, "py_func", score_mod)
            eps = 1e-5 * np.maximum(1.0, np.abs(s))
            grad = (call(fn, s + eps, bi, hi, qi, ki) - call(fn, s - eps, bi, hi, qi, ki)) / (2 * eps)
            grad = np.where(np.isfinite(grad), grad, 0.0)   # a score_mod that returns -inf
            s = call(fn, s, bi, hi, qi, ki)
        keep = np.ones(s.shape, dtype=bool)
        if mask_mod is not None:
            fn = getattr(mask_mod, "py_func", mask_mod)
            keep = np.broadcast_to(call(fn, bi, hi, qi, ki) != 0, s.shape)
        return s, keep, grad

    return mod


def attention(q, k, v, *, causal=False, softmax_scale=None, rows=None, window_size=(-1, -1),
              softcap=0.0, align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None,
              dropout_p=0.0, dropout_mask=None, attention_chunk=0, score_mod=None,
              mask_mod=None, aux=(), batch_offset=0):
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
    ok = visible(rows, k.shape[1], causal, window_size, align, n_q, attention_chunk)
    bias = alibi_bias(alibi_slopes, b, h, rows, k.shape[1], n_q, align)
    p, lse, _ = softmax_rows(qh @ kh, ok, softmax_scale, softcap, bias, sinks,
                             modded(score_mod, mask_mod, aux, batch_offset), rows)
    p = dropped(p, dropout_p, dropout_mask, rows)
    return (p @ vh).transpose(0, 2, 1, 3), lse


def dropped(x, dropout_p, dropout_mask, rows):
    """x (B, H, len(rows), N_k) times Z / (1 - p); x without a mask. The mask: every query row's
    (N_q of them: the rows' part taken) or the rows' own (len(rows), as keep_mask(rows=) makes)."""
    if dropout_mask is None:
        return x
    z = np.asarray(dropout_mask)
    if z.shape[2] != len(rows):
        z = z[:, :, rows]
    return x * z / (1.0 - dropout_p)


def softmax_rows(qk, ok, softmax_scale, softcap=0.0, bias=0.0, sinks=None, mod=None, rows=None):
    """P = softmax(S) of S = softmax_scale * QK^T (soft-capped if softcap > 0, plus `bias`, then
    `mod`ded: `modded`'s function of S and the query rows), its log-sum-exp, and dS_final/dS (1
    where there is no cap and no score_mod); `ok` marks the scores that count (others are
    masked); sinks (H,): each head's sink logit joins its rows' normaliser. A row with every
    score masked gets P = 0 and LSE = -inf (with a sink: the sink's logit)."""
    s = qk * softmax_scale
    cap_grad = np.ones_like(s)
    if softcap:
        t = np.tanh(s / softcap)
        s, cap_grad = softcap * t, 1 - t * t
    s = s + bias
    if mod is not None:
        s, keep, mod_grad = mod(s, rows)
        ok = ok & keep
        cap_grad = cap_grad * mod_grad
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[None, :, None, None]
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - m)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (m + np.log(l))[..., 0]
        p = np.where(l > 0, e / l, 0.0)
    return p, lse, cap_grad


def attention_backward(q, k, v, do, *, causal=False, softmax_scale=None, block_rows=1024,
                       window_size=(-1, -1), softcap=0.0, align=masks.BOTTOM_RIGHT,
                       alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_mask=None,
                       attention_chunk=0, score_mod=None, mask_mod=None, aux=(), batch_offset=0,
                       return_ds=False):
    """float64 gradients (dq, dk, dv) of sum(O * dO) for O = attention(q, k, v): with P the
    softmax, dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(dO o O)) (times 1 - tanh^2 with a
    softcap; with dropout, P_Z = Z o P / (1 - p): dV = P_Z^T dO, dP = Z o dO V^T / (1 - p), O and
    so D from P_Z), dQ = scale dS K, dK = scale dS^T Q; K/V heads shared by a group of query heads sum
    the group's gradients. ALiBi's bias is no function of the scores (dS unchanged). With sinks
    the sink's share of each row, P_sink = exp(s_h - LSE), gives d s_h = -sum P_sink rowsum(dO o O)
    (its dP is 0: the sink has no value), returned as a fourth gradient (H,).
    Every row's P, dP and dS depend on that row alone, so rows are taken `block_rows` at a time
    (memory: block_rows x N_k per head, not N_q x N_k). score_mod, mask_mod, aux: as attention's,
    dS taken through score_mod's derivative; return_ds: also dS of the modified scores
    (B, H, N_q, N_k), what a learnable aux's gradient sums."""
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
    dsinks = np.zeros(h)
    mod = modded(score_mod, mask_mod, aux, batch_offset)
    ds_all = np.zeros((b, h, n_q, n_k)) if return_ds else None
    for r0 in range(0, n_q, block_rows):
        rows = np.arange(r0, min(n_q, r0 + block_rows))
        qb, dob = qh[:, :, rows], doh[:, :, rows]
        ok = visible(rows, n_k, causal, window_size, align, n_q, attention_chunk)
        bias = alibi_bias(alibi_slopes, b, h, rows, n_k, n_q, align)
        p, lse, cap_grad = softmax_rows(qb @ kh.transpose(0, 1, 3, 2), ok, softmax_scale,
                                        softcap, bias, sinks, mod, rows)
        p_z = dropped(p, dropout_p, dropout_mask, rows)
        ob = p_z @ vh
        dv += p_z.transpose(0, 1, 3, 2) @ dob
        d_rows = (dob * ob).sum(axis=-1, keepdims=True)
        ds = p * (dropped(dob @ vh.transpose(0, 1, 3, 2), dropout_p, dropout_mask, rows) - d_rows)
        if sinks is not None:
            p_sink = np.exp(np.asarray(sinks, np.float64)[None, :, None] - lse)   # (B, H, rows)
            dsinks -= (p_sink * d_rows[..., 0]).sum(axis=(0, 2))
        if return_ds:
            ds_all[:, :, rows] = ds
        ds = ds * cap_grad
        dq[:, :, rows] = softmax_scale * ds @ kh
        dk += softmax_scale * ds.transpose(0, 1, 3, 2) @ qb

    def per_kv_head(x):      # (B, H, N_k, d) -> (B, N_k, H_kv, d), summed over each group
        return x.reshape(b, h_kv, group, n_k, x.shape[-1]).sum(axis=2).transpose(0, 2, 1, 3)

    grads = dq.transpose(0, 2, 1, 3), per_kv_head(dk), per_kv_head(dv)
    grads = grads if sinks is None else grads + (dsinks,)
    return grads + (ds_all,) if return_ds else grads


def rotary(x, cos, sin, positions, interleaved):
    """RoPE in float64 on x (B, N, H, d): token i of sequence b at position positions[b, i],
    the first 2 * cos.shape[1] columns rotated in pairs ((2j, 2j + 1) if interleaved, else
    (j, j + rotary_dim / 2)) by cos[p, j], sin[p, j]; returned in float64 (the caller rounds it
    to the inputs' type, as a kernel does)."""
    x = np.asarray(x, dtype=np.float64).copy()
    half = cos.shape[1]
    c = np.asarray(cos, dtype=np.float64)[positions][:, :, None, :]   # (B, N, 1, half)
    s = np.asarray(sin, dtype=np.float64)[positions][:, :, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = a * c - b * s, b * c + a * s
    return x
