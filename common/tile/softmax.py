"""Online softmax over the rows of an mma accumulator (FA2 Alg. 1 lines 9, 10, 12, 13), and the
softmax's backward (FA2 Alg. 2 lines 13 and 16: P rebuilt from L, dS = P o (dP - D)).

In an m16n8 accumulator, lane (g = lane // 4, t = lane % 4) holds rows g and g + 8 of every m-tile,
two columns per n-tile. A full row therefore lives in the 4 lanes of a quad: row-wise max and sum
are the lane's own values reduced across the quad with two xor-shuffles.

Row statistics are arrays indexed r = 2*m + h (m-tile m, h = 0 for row g, 1 for row g + 8):
- m_i: running row max of the raw scores (before softmax_scale);
- l_i: running row sum of exp, kept per lane (partial over the lane's columns) until `finalize`,
  which reduces it across the quad once (FA2 defers every normalisation to the end).
Exponentials are base 2: exp(scale * (s - m)) = 2^(s * scale*log2(e) - m * scale*log2(e)), one FFMA
and one ex2.approx per score.
"""
import math

from numba import float32

from common.hardware import ptx
from common.hardware.target import device_function

LOG2E = 1.4426950408889634


@device_function
def quad_max(x):
    x = max(x, ptx.shfl_xor_f32(x, 1))
    return max(x, ptx.shfl_xor_f32(x, 2))


@device_function
def quad_sum(x):
    x = x + ptx.shfl_xor_f32(x, 1)
    return x + ptx.shfl_xor_f32(x, 2)


@device_function
def init_rows(m_i, l_i):
    """Alg.1 l.5: m = -inf, l = 0."""
    for r in range(m_i.shape[0]):
        m_i[r] = float32(-math.inf)
        l_i[r] = float32(0)


@device_function
def init_rows_with_sink(m_i, l_i, sink, lane):
    """Alg.1 l.5 with an attention sink (gpt-oss): the sink's logit `sink` (in raw-score units,
    s_h / softmax_scale) as a first column of value 0 already seen, m = sink and l = 1 (l is kept
    per lane until `finalize` sums the quad: one lane of each quad holds the 1)."""
    for r in range(m_i.shape[0]):
        m_i[r] = sink
        l_i[r] = float32(1) if lane & 3 == 0 else float32(0)


@device_function
def lane_row_max(s, m, h, init):
    """max(init, the lane's scores in row half h of m-tile m); quad_max completes the row."""
    x = init
    for n in range(s.shape[1]):
        x = max(x, max(s[m, n, 2 * h], s[m, n, 2 * h + 1]))
    return x


@device_function
def tanh(x):
    """tanh(x) = 1 - 2 / (1 + 2^(2x log2 e)): two MUFU instructions (ex2, rcp), absolute error
    ~5e-7 (what a capped score needs: its error enters the exponent as softcap times it), where
    libdevice's tanhf measured 1.4x the causal forward's time with softcap on an H100 and
    tanh.approx.f32's 2^-11 relative error would move P by ~1% at softcap 30. Saturates to +-1."""
    return float32(1) - float32(2) * ptx.rcp_approx(float32(1) + ptx.ex2_approx(x * float32(2 * LOG2E)))


@device_function
def softcap_scores(s, cap):
    """Logit soft-capping (Gemma 2) on raw scores, in place: S <- cap * tanh(S / cap), with
    cap = softcap / softmax_scale (common/tile/masks.py), before any masking."""
    inv = float32(1) / cap
    for m in range(s.shape[0]):
        for n in range(s.shape[1]):
            for j in range(s.shape[2]):
                s[m, n, j] = cap * tanh(s[m, n, j] * inv)


@device_function
def softcap_scores_with_grad(s, grad, cap):
    """softcap_scores, and grad <- dS'/dS = 1 - tanh(S / cap)^2 of each score (the backward's
    factor on dS)."""
    inv = float32(1) / cap
    for m in range(s.shape[0]):
        for n in range(s.shape[1]):
            for j in range(s.shape[2]):
                t = tanh(s[m, n, j] * inv)
                s[m, n, j] = cap * t
                grad[m, n, j] = float32(1) - t * t


@device_function
def exp2_base(row_max, scale_log2):
    """The exponent offset of a row whose max is row_max: row_max * scale*log2(e), or 0 for a row
    with every score masked so far (m = -inf), whose P~ is then exactly 0 instead of NaN."""
    return float32(0) if row_max == float32(-math.inf) else row_max * scale_log2


@device_function
def exp2(x, n, poly_every):
    """2^x for a score of n-tile n: on the MUFU unit (ex2.approx), or, for one n-tile in every
    `poly_every` (0: none), by a polynomial on the FMA units (ptx.ex2_poly, FA4's software
    exponential, for a softmax bound by the MUFU's 16 a clock an SM; on an H100 fa3's FP8 softmax
    is not, and it measured slower: docs/performance/fp8.md, "Exponentials on the FMA units"). n is a constant of the unrolled loops,
    so the choice is made at compile time."""
    if poly_every > 0 and n % poly_every == poly_every - 1:
        return ptx.ex2_poly(x)
    return ptx.ex2_approx(x)


@device_function
def exponentiate_row(s, m, h, base, scale_log2, poly_every):
    """S <- P~ = exp(S - m) = 2^(S * scale*log2(e) - base) in place for row half h of m-tile m;
    returns the lane's part of rowsum(P~). poly_every: see `exp2`."""
    row_sum = float32(0)
    for n in range(s.shape[1]):
        for j in range(2 * h, 2 * h + 2):
            p = exp2(s[m, n, j] * scale_log2 - base, n, poly_every)
            s[m, n, j] = p
            row_sum += p
    return row_sum


@device_function
def advance_row(s, m, h, r, row_max, m_i, l_i, scale_log2, exp_scale, log2_shift, poly_every):
    """Row r (row half h of m-tile m) once its new running max row_max is known: S <- P~ =
    2^(S exp_scale - base) with base = row_max scale_log2, m_i[r] <- row_max, l_i[r] <-
    exp(m_old - m_new) l_i[r] + the lane's rowsum(P~); returns exp(m_old - m_new)."""
    base = exp2_base(row_max, scale_log2)
    alpha = ptx.ex2_approx(m_i[r] * scale_log2 - base)
    m_i[r] = row_max
    l_i[r] = l_i[r] * alpha + exponentiate_row(s, m, h, base - log2_shift, exp_scale, poly_every)
    return alpha


@device_function
def scaled_row_max(s, m, h, m_old, s_scale):
    """max(m_old, rowmax(s_scale S)) for s_scale > 0: the row's max of S taken, then scaled once."""
    return max(m_old, s_scale * quad_max(lane_row_max(s, m, h, float32(-math.inf))))


@device_function
def rescale_row(o, m, h, alpha):
    """Row half h of m-tile m of the O accumulator times alpha."""
    for d in range(o.shape[1]):
        o[m, d, 2 * h] *= alpha
        o[m, d, 2 * h + 1] *= alpha


@device_function
def online_softmax(s, m_i, l_i, o, scale_log2, log2_shift, poly_every):
    """Alg.1 l.9 and the rescale of l.10 for one K/V block, in place:
    m_new = max(m_old, rowmax(S)); S <- P~ = exp(S - m_new); l = exp(m_old - m_new) l + rowsum(P~);
    O <- diag(exp(m_old - m_new)) O. (Scores already masked to -inf where they do not count.)
    log2_shift (0 but for FP8) scales P~, and so l and O, by 2^log2_shift at no cost: FP8's P~ is
    kept clear of e4m3's underflow (variants/fp8.py); O / l is unchanged, L = LSE needs the shift
    taken off. poly_every: which exponentials take the FMA units (`exp2`; 0: none)."""
    for m in range(s.shape[0]):
        for h in range(2):
            r = 2 * m + h
            alpha = advance_row(s, m, h, r, quad_max(lane_row_max(s, m, h, m_i[r])), m_i, l_i,
                                scale_log2, scale_log2, log2_shift, poly_every)
            rescale_row(o, m, h, alpha)


@device_function
def online_softmax_scaled(s, s_scale, m_i, l_i, o, scale_log2, log2_shift, poly_every):
    """online_softmax of s_scale S (s_scale > 0, one factor for the whole block: FP8's per-block K
    descale) without multiplying S: max is monotone, so each row's max is scaled once, and the
    factor joins the exponent's scale, (s_scale S) scale_log2 = S (s_scale scale_log2), in the
    FFMA each score takes anyway. m_i stays in the units of s_scale S."""
    for m in range(s.shape[0]):
        for h in range(2):
            r = 2 * m + h
            alpha = advance_row(s, m, h, r, scaled_row_max(s, m, h, m_i[r], s_scale), m_i, l_i,
                                scale_log2, scale_log2 * s_scale, log2_shift, poly_every)
            rescale_row(o, m, h, alpha)


@device_function
def online_softmax_deferred(s, m_i, l_i, alpha, scale_log2, log2_shift, poly_every):
    """online_softmax without touching O: S <- P~, m and l updated, and each row's rescale factor
    exp(m_old - m_new) left in alpha[r] for O to be rescaled later (`tiles.scale_rows`), once the
    MMA still accumulating into O has completed (FA3's intra-warpgroup overlap)."""
    for m in range(s.shape[0]):
        for h in range(2):
            r = 2 * m + h
            alpha[r] = advance_row(s, m, h, r, quad_max(lane_row_max(s, m, h, m_i[r])), m_i, l_i,
                                   scale_log2, scale_log2, log2_shift, poly_every)


@device_function
def online_softmax_deferred_scaled(s, s_scale, m_i, l_i, alpha, scale_log2, log2_shift,
                                   poly_every):
    """online_softmax_deferred of s_scale S, as online_softmax_scaled."""
    for m in range(s.shape[0]):
        for h in range(2):
            r = 2 * m + h
            alpha[r] = advance_row(s, m, h, r, scaled_row_max(s, m, h, m_i[r], s_scale), m_i,
                                   l_i, scale_log2, scale_log2 * s_scale, log2_shift, poly_every)


@device_function
def merge_statistics(m_old, l_old, m_blk, l_blk, scale_log2):
    """FA1 Alg.1 l.11 for one row: the running (m, l) and a block's own (m~, l~) (its P~ taken
    against m~) -> (m_new, l_new, e^(m_old - m_new), e^(m~ - m_new)); the two factors rescale the
    old O and the block's P~ V."""
    m_new = max(m_old, m_blk)
    base = exp2_base(m_new, scale_log2)
    alpha = ptx.ex2_approx(m_old * scale_log2 - base)
    beta = ptx.ex2_approx(m_blk * scale_log2 - base)
    return m_new, alpha * l_old + beta * l_blk, alpha, beta


@device_function
def finalize(m_i, l_i, inv_l, lse, softmax_scale):
    """Alg.1 l.12-13 for the held rows: inv_l = 1 / l (to scale O once) and
    L = m * softmax_scale + log(l). A row with no unmasked score gets O = 0 and L = -inf."""
    for r in range(m_i.shape[0]):
        total = quad_sum(l_i[r])
        if total > float32(0):
            inv_l[r] = float32(1) / total
            lse[r] = m_i[r] * softmax_scale + math.log(total)
        else:
            inv_l[r] = float32(0)
            lse[r] = float32(-math.inf)


# --------------------------------------------------------------------------- backward
# The backward pass rebuilds P from the saved L = LSE instead of storing it (FA2 Alg. 2 l.13):
# P = exp(scale * S - L) = 2^(S * scale*log2(e) - L*log2(e)); the kernels keep L*log2(e) ("lse2").
# In S^T (keys x queries, the layout of the K/V-block-outer kernel) L and D are per column and are
# read from shared memory; in S (queries x keys) they are per row and held in registers.


@device_function
def lse_log2(lse):
    """L*log2(e) for P = 2^(S*scale*log2(e) - L*log2(e)); a row with L = -inf (every score masked)
    gets +inf, so that its P is 0 rather than NaN."""
    return float32(math.inf) if lse == float32(-math.inf) else lse * float32(LOG2E)


@device_function
def recompute_p_columns(s, lse2, lane, scale_log2, col0=0):
    """S^T <- P^T in place: P^T[r, c] = 2^(S^T[r, c] * scale*log2(e) - lse2[col0 + c]), lse2 a
    shared array over the block's columns (queries), col0 the warp's first."""
    t2 = col0 + 2 * (lane & 3)
    for n in range(s.shape[1]):
        l0 = lse2[n * 8 + t2]
        l1 = lse2[n * 8 + t2 + 1]
        for m in range(s.shape[0]):
            for h in range(2):
                s[m, n, 2 * h] = ptx.ex2_approx(s[m, n, 2 * h] * scale_log2 - l0)
                s[m, n, 2 * h + 1] = ptx.ex2_approx(s[m, n, 2 * h + 1] * scale_log2 - l1)


@device_function
def grad_columns(p, dp, d_vec, lane, col0=0, signed=False):
    """dP^T <- dS^T = P^T o (dP^T - D) in place, D = rowsum(dO o O) a shared array over the
    block's columns (queries), col0 the warp's first. signed: P^T's sign carries dropout's mask
    (common/tile/dropout.py: drop_transposed), so |P^T| is the probability."""
    t2 = col0 + 2 * (lane & 3)
    for n in range(p.shape[1]):
        d0 = d_vec[n * 8 + t2]
        d1 = d_vec[n * 8 + t2 + 1]
        for m in range(p.shape[0]):
            for h in range(2):
                p0, p1 = p[m, n, 2 * h], p[m, n, 2 * h + 1]
                if signed:
                    p0, p1 = abs(p0), abs(p1)
                dp[m, n, 2 * h] = p0 * (dp[m, n, 2 * h] - d0)
                dp[m, n, 2 * h + 1] = p1 * (dp[m, n, 2 * h + 1] - d1)


@device_function
def recompute_p_rows(s, lse2, scale_log2):
    """S <- P in place: P[r, c] = 2^(S[r, c] * scale*log2(e) - lse2[2m + h]) for the lane's rows."""
    for m in range(s.shape[0]):
        for n in range(s.shape[1]):
            for j in range(4):
                s[m, n, j] = ptx.ex2_approx(s[m, n, j] * scale_log2 - lse2[2 * m + (j >> 1)])


@device_function
def grad_rows(p, dp, d_rows):
    """dP <- dS = P o (dP - D) in place, D[2m + h] for the lane's rows."""
    for m in range(p.shape[0]):
        for n in range(p.shape[1]):
            for j in range(4):
                dp[m, n, j] = p[m, n, j] * (dp[m, n, j] - d_rows[2 * m + (j >> 1)])
