"""Dropout on P (FA2 Alg. 1 l.11, Alg. 2 l.13-14): a keep mask made in the kernel by a
counter-based RNG, so that the backward regenerates the forward's mask without storing it.

    P_dropped = Z o P / (1 - p),  Z[i, j] = 1 with probability 1 - p (else 0),
    O = P_dropped V;  dV = P_dropped^T dO;  dS = P o (Z o dP / (1 - p) - D),  D = rowsum(dO o O).

The RNG is Philox-4x32 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"; the
generator of torch's, cuRAND's and flash_attn's GPU dropout) with 7 rounds, as FlashAttention-2's
kernels run it (csrc/flash_attn/src/philox.cuh; the paper finds Philox4x32 Crush-resistant from 7
rounds; Random123's default of 10 costs 3/7 more of the RNG's instructions): a 4 x 32-bit counter
and a 2 x 32-bit key give four 32-bit numbers, i.e. 16 random bytes. Byte < T keeps the element,
T = round(256 (1 - p)), so each element's keep probability is T / 256 (p rounded to a multiple of 1/256, as flash_attn's
8-bit threshold does); the kept values are scaled by exactly 1 / (1 - p).

Z is a function of (seed, offset, b, h, i, j) alone (i a query, j a key of sequence b, head h),
the same whatever the kernel, its tiles or its warps; `keep_mask` is its NumPy model, the float64
reference's mask. One Philox call covers the 16 elements one lane of an mma.m16n8 accumulator
holds in 32 columns of one m16 tile (rows g, g+8; four n8 tiles, two columns each; lane = 4 g + t):

    call   counter = (group, b H + h, offset mod 2^32, offset div 2^32),  key = (seed mod 2^32,
           seed div 2^32),  group = (8 (i >> 4) + (i & 7)) CG + 4 (j >> 5) + ((j & 7) >> 1),
           CG = 4 ceil(N_k / 32) (a packed batch: its longest key sequence's N_k)
    byte   8 ((i >> 3) & 1) + 2 ((j >> 3) & 3) + (j & 1) of the call's 16 (word byte // 4, bits
           8 (byte % 4) up)

so a kernel with queries as rows (the forward, the backward's dQ kernel) uses all 16 bytes of
each call. The backward's K/V kernel holds S^T (keys as rows): a call's 16 elements then sit in
two lanes, 8 each (keys of one parity, `j & 1`); the two compute one call each and swap the
partner's 8 bytes by one shuffle of two words (`drop_transposed`), so that it too makes one
call per 16 elements. The counter's group and head words never repeat within a call, and its
offset words separate calls: torch's generator hands each call a new offset
(variants/autograd.py: philox_seed_offset), as it does for its own dropout.
"""
import numpy as np
from numba import float32, uint32, uint64

from common.hardware import ptx
from common.hardware.target import device_function

# Philox-4x32's round multipliers and Weyl key increments (Random123's PHILOX_M4x32_*, W32_*).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 7          # the kernels' (FlashAttention-2's); Random123's known answers are for 10
LOW32 = 0xFFFFFFFF
MAX_GROUPS = 1 << 32     # a call's groups must fit the counter's first word


def threshold(p):
    """The 8-bit keep threshold of dropout probability p: byte < T keeps, T = round(256 (1 - p))."""
    return int(round(256 * (1.0 - p)))


def column_groups(n_k):
    """CG: groups a row of groups spans, 4 per 32 keys."""
    return 4 * ((n_k + 31) // 32)


def check_groups(n_q, n_k):
    """Raise if a head's groups would overflow the counter's 32-bit group word."""
    rows = 8 * ((n_q + 15) // 16)
    if rows * column_groups(n_k) > MAX_GROUPS:
        raise ValueError(f"dropout: N_q={n_q} x N_k={n_k} needs more than 2^32 Philox counters a "
                         f"head (about N_q N_k / 16); split the sequence")


# --------------------------------------------------------------------------- the RNG


@device_function
def mulhilo(a, b):
    """(hi, lo) 32-bit halves of the 64-bit product a * b (one IMAD.WIDE.U32)."""
    prod = uint64(a) * uint64(b)
    return uint32(prod >> uint64(32)), uint32(prod & uint64(LOW32))


@device_function
def philox_rounds(c0, c1, c2, c3, k0, k1, rounds):
    """Philox-4x32-`rounds` of counter (c0, c1, c2, c3) and key (k0, k1): four uint32 (all
    uint32; rounds a constant, so that the loop unrolls)."""
    for r in range(rounds):
        hi0, lo0 = mulhilo(uint32(M0), c0)
        hi1, lo1 = mulhilo(uint32(M1), c2)
        c0, c1, c2, c3 = uint32(hi1 ^ c1 ^ k0), lo1, uint32(hi0 ^ c3 ^ k1), lo0
        if r < rounds - 1:
            k0 = uint32((uint64(k0) + uint64(W0)) & uint64(LOW32))
            k1 = uint32((uint64(k1) + uint64(W1)) & uint64(LOW32))
    return c0, c1, c2, c3


@device_function
def philox(c0, c1, c2, c3, k0, k1):
    """The kernels' Philox: ROUNDS rounds."""
    return philox_rounds(c0, c1, c2, c3, k0, k1, ROUNDS)


def philox_numpy(c0, c1, c2, c3, k0, k1, rounds=ROUNDS):
    """Philox-4x32-`rounds` over arrays of counters (any broadcastable uint32 arrays or ints): a
    tuple of four uint32 arrays. The model `philox` is checked against (and, at 10 rounds,
    Random123's known answers)."""
    c = [np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(k0), np.uint64(k1)
    c = np.broadcast_arrays(*c)
    for r in range(rounds):
        p0 = np.uint64(M0) * c[0]
        p1 = np.uint64(M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & np.uint64(LOW32),
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & np.uint64(LOW32)]
        k0 = (k0 + np.uint64(W0)) & np.uint64(LOW32)
        k1 = (k1 + np.uint64(W1)) & np.uint64(LOW32)
    return tuple(x.astype(np.uint32) for x in c)


# --------------------------------------------------------------------------- the mask, in kernels


@device_function
def byte_keeps(word, shift, keep_below):
    """Whether the byte at bit `shift` of `word` is below the threshold (the element is kept)."""
    return uint32((word >> uint32(shift)) & uint32(0xFF)) < keep_below


@device_function
def drop_rows(x, row0, col0, lane, bh, cg, rng, scale):
    """x (M, n, 4), an accumulator with queries as rows (S, P~ or dP; n a multiple of 4) <- x *
    scale where kept, 0 where dropped. row0: the first query of the warp's first m16 tile (a
    multiple of 16), col0: the first key of the tile (a multiple of 32); bh = b H + h; cg =
    column_groups(N_k); rng = (seed_lo, seed_hi, offset_lo, offset_hi, threshold)."""
    g, t = lane >> 2, lane & 3
    for m in range(x.shape[0]):
        row_part = uint32(8 * ((row0 + 16 * m) >> 4) + g)
        for c in range(x.shape[1] // 4):
            group = uint32(row_part * uint32(cg) + uint32(4 * ((col0 + 32 * c) >> 5) + t))
            words = philox(group, uint32(bh), rng[2], rng[3], rng[0], rng[1])
            for n in range(4):
                for h in range(2):
                    word = words[2 * h + (n >> 1)]
                    for e in range(2):
                        keep = byte_keeps(word, 8 * (2 * (n & 1) + e), rng[4])
                        v = x[m, 4 * c + n, 2 * h + e]
                        x[m, 4 * c + n, 2 * h + e] = v * scale if keep else float32(0)


@device_function
def parity_bytes(lo, hi, parity):
    """The 4 bytes of parity `parity` (0: bytes 0, 2, 4, 6; 1: 1, 3, 5, 7) of the 8 bytes hi:lo,
    in order (one prmt)."""
    return ptx.prmt(lo, hi, uint32(0x6420) + uint32(0x1111) * uint32(parity))


@device_function
def drop_transposed(p, dp, key0, query0, lane, bh, cg, rng, scale):
    """The backward's K/V kernel, with keys as rows (P^T, dP^T (M, n, 4), M even, n even):
    dp <- dp * scale where kept, 0 where dropped, and each dropped element's P^T negated (its
    sign carries the mask to `unsign` and softmax.grad_columns(signed=True); P >= 0). key0: the
    warp's first key (a multiple of 32), query0: its first query (a multiple of 16).

    Element (key, query) = (key0 + 32 mp + 16 mm + 8 h + g, query0 + 16 nq + 8 n2 + 2 t + e) of
    lane (g, t) is byte 8 n2 + 2 (2 mm + h) + (g & 1) of call (mp, nq, e) (the module's
    docstring): lane g and lane g ^ 1 (lane ^ 4) need the same calls, each the bytes of its own
    parity g & 1. So the lane makes call e = g & 1 only, keeps its parity's 8 bytes, and sends its
    partner the other 8 (two words, one prmt each, then two shuffles); the partner's call e' = 1 -
    (g & 1) comes back the same way. Either way the lane then holds, for each e, 8 bytes in two
    words whose byte 2 mm + h of word n2 is the element's: no shift that depends on the lane."""
    g, t = lane >> 2, lane & 3
    mine = uint32(g & 1)
    col_part = uint32(4 * (key0 >> 5) + (g >> 1))
    for mp in range(p.shape[0] // 2):
        col = uint32(col_part + uint32(4 * mp))       # keys key0 + 32 mp ..
        for nq in range(p.shape[1] // 2):
            # call e = mine: query rows 2t + mine of the 16 from query0 + 16 nq
            row_part = uint32(8 * ((query0 + 16 * nq) >> 4) + 2 * t + mine)
            w = philox(uint32(row_part * uint32(cg) + col), uint32(bh), rng[2], rng[3], rng[0],
                       rng[1])
            own0, own1 = parity_bytes(w[0], w[1], mine), parity_bytes(w[2], w[3], mine)
            got0 = ptx.shfl_xor_u32(parity_bytes(w[0], w[1], 1 - mine), 4)
            got1 = ptx.shfl_xor_u32(parity_bytes(w[2], w[3], 1 - mine), 4)
            for e in range(2):
                ours = mine == uint32(e)               # call e is this lane's own, or its partner's
                words = (own0 if ours else got0, own1 if ours else got1)
                for mm in range(2):
                    m = 2 * mp + mm
                    for n2 in range(2):
                        n = 2 * nq + n2
                        for h in range(2):
                            keep = byte_keeps(words[n2], 8 * (2 * mm + h), rng[4])
                            if keep:
                                dp[m, n, 2 * h + e] = dp[m, n, 2 * h + e] * scale
                            else:
                                dp[m, n, 2 * h + e] = float32(0)
                                p[m, n, 2 * h + e] = -p[m, n, 2 * h + e]


@device_function
def unsign(p, scale):
    """P^T after softmax.grad_columns(signed=True) -> the dV operand Z o P^T * scale: dropped
    (negative) elements 0, kept ones scaled."""
    for m in range(p.shape[0]):
        for n in range(p.shape[1]):
            for j in range(p.shape[2]):
                p[m, n, j] = max(p[m, n, j], float32(0)) * scale


@device_function
def scale_rows(x, scale):
    """x *= scale (the forward's 1 / (1 - p) on O, folded into 1 / l)."""
    for r in range(x.shape[0]):
        x[r] = x[r] * scale


# --------------------------------------------------------------------------- the host's model


def keep_mask(seed, offset, p, batch, heads, n_q, n_k, cg=None, rows=None, batches=None,
              head_ids=None):
    """Z (batch, heads, n_q, n_k) bool as the kernels make it (the module's docstring); cg: the
    call's column_groups (a packed batch's longest sequence; default column_groups(n_k)). rows,
    batches, head_ids (index arrays) restrict Z to those queries, batches and heads (the
    reference's checked rows; a backward check's heads) without making the rest."""
    cg = column_groups(n_k) if cg is None else cg
    rows = np.arange(n_q) if rows is None else np.asarray(rows)
    batches = np.arange(batch) if batches is None else np.asarray(batches)
    head_ids = np.arange(heads) if head_ids is None else np.asarray(head_ids)
    i = rows.astype(np.uint64)[:, None]
    j = np.arange(n_k, dtype=np.uint64)[None, :]
    group = ((np.uint64(8) * (i >> np.uint64(4)) + (i & np.uint64(7))) * np.uint64(cg)
             + np.uint64(4) * (j >> np.uint64(5)) + ((j & np.uint64(7)) >> np.uint64(1)))
    byte = (np.uint64(8) * ((i >> np.uint64(3)) & np.uint64(1))
            + np.uint64(2) * ((j >> np.uint64(3)) & np.uint64(3)) + (j & np.uint64(1)))
    word, shift = (byte >> np.uint64(2)).astype(np.intp), np.uint64(8) * (byte & np.uint64(3))
    bh = (batches[:, None] * heads + head_ids[None, :]).astype(np.uint64).reshape(-1, 1, 1)
    offset, seed = int(offset), int(seed)
    keep = np.empty((len(bh), len(rows), n_k), dtype=bool)
    below = np.uint64(threshold(p))
    for n, one in enumerate(bh):      # a head at a time: 4 words an element live at once
        words = np.stack(philox_numpy(group, one, offset & LOW32, offset >> 32, seed & LOW32,
                                      seed >> 32), axis=-1)
        chosen = np.take_along_axis(words, word[..., None], axis=-1)[..., 0].astype(np.uint64)
        keep[n] = ((chosen >> shift) & np.uint64(0xFF)) < below
    return keep.reshape(len(batches), len(head_ids), len(rows), n_k)


def rng_args(seed, offset, p):
    """The kernels' dropout arguments: (seed_lo, seed_hi, offset_lo, offset_hi, threshold) uint32
    and the scale 1 / (1 - p) fp32."""
    seed, offset = int(seed), int(offset)
    return (np.uint32(seed & LOW32), np.uint32(seed >> 32 & LOW32), np.uint32(offset & LOW32),
            np.uint32(offset >> 32 & LOW32), np.uint32(threshold(p)),
            np.float32(1.0 / (1.0 - p)))
