"""What each lane of a warp holds, in NumPy: the per-lane semantics of the sm_80-style
instructions (mma.m16n8k16's fragments, ldmatrix.x4) over all 32 lanes at once, and the 16-bit and
e4m3 conversions, written once.

The simulator stand-ins of common/hardware/sm80.py compute with them (sm90's wgmma stand-ins with the
fragment and conversion functions), and the tests check the real instructions on a GPU against
them (the tests import this module as `sem`). A module of its own because it is the specification
both sides share: pure NumPy (and ml_dtypes), importable with or without the simulator.
"""
import ml_dtypes
import numpy as np

# PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type": with g = lane // 4 and
# t = lane % 4, register j of a lane holds two consecutive 16-bit elements (low half first):
#   A (16x16, row-major): a0 (g, 2t), a1 (g+8, 2t), a2 (g, 2t+8), a3 (g+8, 2t+8)
#   B (16x8,  "col"):     b0 (k=2t, n=g), b1 (k=2t+8, n=g)      (the pair runs along k)
#   C, D (16x8, f32):     c0,c1 (g, 2t), (g, 2t+1); c2,c3 (g+8, 2t), (g+8, 2t+1)

_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def halves_to_float(bits, dtype):
    """uint16 bit patterns -> float64 values of a 16-bit float type ('bfloat16' or 'float16')."""
    return np.asarray(bits, dtype=np.uint16).view(_DTYPES[dtype]).astype(np.float64)


def float_to_halves(x, dtype):
    """float values -> uint16 bit patterns, rounded to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(_DTYPES[dtype]).view(np.uint16)


E4M3_MAX = 448.0


def bytes_to_float(bits):
    """uint8 bit patterns of float8_e4m3fn -> float64 values."""
    return np.asarray(bits, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def float_to_e4m3(x):
    """fp32 values -> float8_e4m3fn bit patterns as cvt.rn.satfinite does it: rounded to nearest
    even, clamped to +-448 (the largest finite e4m3; the format has no infinity), NaN kept."""
    x = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


# exp2 by a polynomial on the FMA units (FA4's software exponential): 2^x = 2^floor(x) * 2^f,
# f = x - floor(x) in [0, 1), 2^f by a degree-3 minimax polynomial (FA4's coefficients; relative
# error below EX2_POLY_REL_ERROR, checked in tests/test_ptx.py), 2^floor(x) in an exponent field.
EX2_POLY = (1.0, 0.695146143436431884765625, 0.227564394474029541015625,
            0.077119089663028717041015625)
EX2_POLY_FLOOR = -127.0   # inputs clamped here: every x < -126 gives exactly 0 (as ex2.approx.ftz,
                          # which flushes those subnormal results to 0)
EX2_POLY_REL_ERROR = 9e-5   # of ex2_poly against 2^x, x in [-126, 127] (measured: 8.8e-5)


def ex2_poly(x):
    """fp32 values -> 2^x as sm80.ex2_poly computes it: x clamped to [-127, inf) as max.f32 does
    it (-inf gives 0; so does NaN, which max.f32 drops: where ex2.approx would pass a NaN score on,
    this gives 0), n = floor(x), f = x - n in fp32 (exact but for tiny negative x, where it rounds
    to 1), p = ((c3 f + c2) f + c1) f + c0 in three fused multiply-adds (each rounded once to
    fp32: float64 holds the product exactly), times 2^n (0 for n = -127). Defined for x < 128
    (from 129 the exponent field overflows into the sign: the PTX gives -0); the kernels' exponents
    are at most FP8's shift of 8."""
    x = np.fmax(np.asarray(x, dtype=np.float32), np.float32(EX2_POLY_FLOOR))
    n = np.floor(x)
    f = (x - n).astype(np.float64)
    c0, c1, c2, c3 = EX2_POLY
    p = np.float32(c3)
    for c in (c2, c1, c0):
        p = (p.astype(np.float64) * f + np.float64(np.float32(c))).astype(np.float32)
    scale = np.where(n > EX2_POLY_FLOOR, np.exp2(n.astype(np.float64)), 0.0)
    return (p.astype(np.float64) * scale).astype(np.float32)


# (row, col) of the 16-bit halves of each lane's registers, in register order (low half first).
_A_ROW = np.stack([_G, _G, _G + 8, _G + 8, _G, _G, _G + 8, _G + 8], axis=1)
_A_COL = np.stack([2 * _T, 2 * _T + 1] * 2 + [2 * _T + 8, 2 * _T + 9] * 2, axis=1)
_B_K = np.stack([2 * _T, 2 * _T + 1, 2 * _T + 8, 2 * _T + 9], axis=1)
_B_N = np.stack([_G] * 4, axis=1)
_C_ROW = np.stack([_G, _G, _G + 8, _G + 8], axis=1)
_C_COL = np.stack([2 * _T, 2 * _T + 1] * 2, axis=1)


def _halves(regs):
    """(32, r) uint32 registers -> (32, 2r) uint16 halves, low half first."""
    return np.ascontiguousarray(regs, dtype=np.uint32).view(np.uint16)


def a_fragment_matrix(a_regs, dtype):
    """32 lanes x 4 uint32 A registers -> the 16x16 matrix they hold."""
    a = np.zeros((16, 16))
    a[_A_ROW, _A_COL] = halves_to_float(_halves(a_regs), dtype)
    return a


def b_fragment_matrix(b_regs, dtype):
    """32 lanes x 2 uint32 B registers -> the 16x8 (k x n) matrix they hold."""
    b = np.zeros((16, 8))
    b[_B_K, _B_N] = halves_to_float(_halves(b_regs), dtype)
    return b


def c_fragment_matrix(c_regs):
    """32 lanes x 4 f32 C/D registers -> the 16x8 matrix they hold."""
    c = np.zeros((16, 8))
    c[_C_ROW, _C_COL] = np.asarray(c_regs, dtype=np.float64)
    return c


def c_fragment_registers(c):
    """16x8 matrix -> the 32 lanes x 4 f32 registers of the C/D fragment."""
    return np.asarray(c, dtype=np.float64)[_C_ROW, _C_COL].astype(np.float32)


def mma_lanes(a_regs, b_regs, c_regs, dtype):
    """D = A B + C for mma.m16n8k16 over the registers of all 32 lanes (fp32 accumulate)."""
    a = a_fragment_matrix(a_regs, dtype)
    b = b_fragment_matrix(b_regs, dtype)
    return c_fragment_registers(a @ b + c_fragment_matrix(c_regs))


def stmatrix_lanes(smem, offsets, regs):
    """stmatrix.x4 (sm_90, the inverse of ldmatrix.x4 without .trans): lanes 8i..8i+7 give the 8
    row offsets of 8x8 matrix i; register i of lane l goes to elements (l//4, 2(l%4)) (low half)
    and (l//4, 2(l%4)+1) of matrix i. smem: 16-bit elements, written in place."""
    smem = np.asarray(smem).view(np.uint16)
    offsets = np.asarray(offsets, dtype=np.int64)
    regs = np.asarray(regs, dtype=np.uint32)
    for i in range(4):
        rows = offsets[8 * i:8 * i + 8]
        smem[rows[_G] + 2 * _T] = (regs[:, i] & 0xFFFF).astype(np.uint16)
        smem[rows[_G] + 2 * _T + 1] = (regs[:, i] >> 16).astype(np.uint16)


def ldmatrix_lanes(smem, offsets, trans):
    """ldmatrix.x4 (.trans): lanes 8i..8i+7 give the 8 row offsets of 8x8 matrix i; register i of
    lane l gets elements (l//4, 2(l%4)) and (l//4, 2(l%4)+1) of matrix i, or with .trans
    (2(l%4), l//4) and (2(l%4)+1, l//4)."""
    smem = np.asarray(smem).view(np.uint16)
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.zeros((32, 4), dtype=np.uint32)
    for i in range(4):
        rows = offsets[8 * i:8 * i + 8]
        if trans:
            lo = smem[rows[2 * _T] + _G]
            hi = smem[rows[2 * _T + 1] + _G]
        else:
            lo = smem[rows[_G] + 2 * _T]
            hi = smem[rows[_G] + 2 * _T + 1]
        out[:, i] = lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)
    return out
