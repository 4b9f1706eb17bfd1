"""Online softmax over the rows of an mma accumulator (FA2 Alg. 1 lines 9, 10, 12, 13).

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

from common import ptx
from common.target import device_function

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
def lane_row_max(s, m, h, init):
    """max(init, the lane's scores in row half h of m-tile m); quad_max completes the row."""
    x = init
    for n in range(s.shape[1]):
        x = max(x, max(s[m, n, 2 * h], s[m, n, 2 * h + 1]))
    return x


@device_function
def exp2_base(row_max, scale_log2):
    """The exponent offset of a row whose max is row_max: row_max * scale*log2(e), or 0 for a row
    with every score masked so far (m = -inf), whose P~ is then exactly 0 instead of NaN."""
    return float32(0) if row_max == float32(-math.inf) else row_max * scale_log2


@device_function
def exponentiate_row(s, m, h, base, scale_log2):
    """S <- P~ = exp(S - m) = 2^(S * scale*log2(e) - base) in place for row half h of m-tile m;
    returns the lane's part of rowsum(P~)."""
    row_sum = float32(0)
    for n in range(s.shape[1]):
        for j in range(2 * h, 2 * h + 2):
            p = ptx.ex2_approx(s[m, n, j] * scale_log2 - base)
            s[m, n, j] = p
            row_sum += p
    return row_sum


@device_function
def online_softmax(s, m_i, l_i, o, scale_log2):
    """Alg.1 l.9 and the rescale of l.10 for one K/V block, in place:
    m_new = max(m_old, rowmax(S)); S <- P~ = exp(S - m_new); l = exp(m_old - m_new) l + rowsum(P~);
    O <- diag(exp(m_old - m_new)) O. (Scores already masked to -inf where they do not count.)"""
    for m in range(s.shape[0]):
        for h in range(2):
            r = 2 * m + h
            row_max = quad_max(lane_row_max(s, m, h, m_i[r]))
            base = exp2_base(row_max, scale_log2)
            alpha = ptx.ex2_approx(m_i[r] * scale_log2 - base)
            m_i[r] = row_max
            l_i[r] = l_i[r] * alpha + exponentiate_row(s, m, h, base, scale_log2)
            for d in range(o.shape[1]):
                o[m, d, 2 * h] *= alpha
                o[m, d, 2 * h + 1] *= alpha


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
