"""The tile layer (common/tile/tiles.py) composed into small GEMM kernels, against NumPy.

Covers both shared layouts (swizzled, padded), both B-operand orders (K-like [n][k] through
ldmatrix, V-like [k][n] through ldmatrix.trans), 128-wide tiles (where the swizzle's column steps
reach past the first 64 columns), the register re-pack of an accumulator as the next A operand,
and the staged 16-byte output path.
"""
from functools import lru_cache

import numpy as np
import pytest
from numba import cuda, float32, int32, uint16, uint32

from common.hardware import elements, ptx
from common.hardware import lanes as sem
from common.tile import tiles
from experiments.measure import inputs

WARPS = 2
THREADS = 32 * WARPS
M = 16 * WARPS


@lru_cache(maxsize=None)
def gemm_kernel(k_dim, n_dim, swizzle, elem, b_is_nk, a_streamed=False):
    """C (M x n) = A (M x k) @ B, B given as [n][k] (b_is_nk) or [k][n]; A held in registers, or
    streamed from shared memory one k-step at a time (a_streamed, with b_is_nk)."""
    SA = tiles.tile_row_stride(k_dim, swizzle)
    b_rows, b_cols = (n_dim, k_dim) if b_is_nk else (k_dim, n_dim)
    SB = tiles.tile_row_stride(b_cols, swizzle)
    A_FRAG, ACC = (1, 1 if a_streamed else k_dim // 16, 4), (1, n_dim // 8, 4)
    tiles.check_tile_copy(M, k_dim, THREADS)
    tiles.check_tile_copy(b_rows, b_cols, THREADS)

    @cuda.jit
    def kernel(a, b, c):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        smem = cuda.shared.array(0, uint16)
        a_s = smem[0:M * SA]
        b_s = smem[M * SA:M * SA + b_rows * SB]
        tiles.load_tile_async(a_s, a, 0, M, 0, M, k_dim, SA, swizzle, tid, THREADS)
        tiles.load_tile_async(b_s, b, 0, b_rows, 0, b_rows, b_cols, SB, swizzle, tid, THREADS)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        frag = cuda.local.array(A_FRAG, uint32)
        acc = cuda.local.array(ACC, float32)
        tiles.fill(acc, float32(0))
        if a_streamed:  # (SA == SB: A and B^T share k_dim columns)
            tiles.gemm_abt_streamed(acc, frag, a_s, 16 * warp, k_dim // 16, b_s, lane, SB, swizzle,
                                    elem)
        else:
            tiles.load_a_fragments(frag, 0, a_s, 16 * warp, lane, SA, swizzle)
            if b_is_nk:
                tiles.gemm_abt(acc, frag, b_s, lane, SB, swizzle, elem)
            else:
                tiles.gemm_ab(acc, frag, b_s, lane, SB, swizzle, elem)
        tiles.store_accumulator_f32(c, acc, 16 * warp, 0, M, n_dim, float32(1), lane)

    return kernel, 2 * (M * SA + b_rows * SB)


def as_float(bits, dtype):
    return sem.halves_to_float(bits, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("swizzle", [True, False])
@pytest.mark.parametrize("b_is_nk, k_dim, n_dim, a_streamed",
                         [(True, 128, 64, False), (True, 128, 64, True), (False, 64, 128, False)])
def test_warp_gemm(rng, dtype, swizzle, b_is_nk, k_dim, n_dim, a_streamed):
    a = inputs.random_qkv(rng, 1, M, 1, k_dim, dtype)[0].reshape(M, k_dim).view(np.uint16)
    b_shape = (n_dim, k_dim) if b_is_nk else (k_dim, n_dim)
    b = inputs.random_qkv(rng, 1, b_shape[0], 1, b_shape[1], dtype)[0].reshape(b_shape).view(np.uint16)
    c = np.full((M, n_dim), np.nan, np.float32)
    elem = elements.element(dtype).code
    kernel, smem = gemm_kernel(k_dim, n_dim, swizzle, elem, b_is_nk, a_streamed)
    kernel[1, THREADS, 0, smem](a, b, c)
    bf = as_float(b, dtype)
    expect = as_float(a, dtype) @ (bf.T if b_is_nk else bf)
    np.testing.assert_allclose(c, expect, rtol=1e-5, atol=1e-4)


@lru_cache(maxsize=None)
def chain_kernel(d, n, swizzle, elem):
    """O = pack(Q K^T) V, scaled per row and stored through a staged tile: the FA2 data path
    without the softmax."""
    S = tiles.tile_row_stride(d, swizzle)
    Q_FRAG, S_ACC, P_FRAG, O_ACC = (1, d // 16, 4), (1, n // 8, 4), (1, n // 16, 4), (1, d // 8, 4)

    @cuda.jit
    def kernel(q, k, v, scale, o32):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        smem = cuda.shared.array(0, uint16)
        q_s, k_s, v_s = smem[0:M * S], smem[M * S:(M + n) * S], smem[(M + n) * S:(M + 2 * n) * S]
        tiles.load_tile_async(q_s, q, 0, M, 0, M, d, S, swizzle, tid, THREADS)
        tiles.load_tile_async(k_s, k, 0, n, 0, n, d, S, swizzle, tid, THREADS)
        tiles.load_tile_async(v_s, v, 0, n, 0, n, d, S, swizzle, tid, THREADS)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        qf = cuda.local.array(Q_FRAG, uint32)
        tiles.load_a_fragments(qf, 0, q_s, 16 * warp, lane, S, swizzle)
        s = cuda.local.array(S_ACC, float32)
        tiles.fill(s, float32(0))
        tiles.gemm_abt(s, qf, k_s, lane, S, swizzle, elem)
        p = cuda.local.array(P_FRAG, uint32)
        tiles.accumulator_to_a(p, s, elem)
        o = cuda.local.array(O_ACC, float32)
        tiles.fill(o, float32(0))
        tiles.gemm_ab(o, p, v_s, lane, S, swizzle, elem)
        row_scale = cuda.local.array(2, float32)
        row_scale[0] = scale[16 * warp + (lane >> 2)]
        row_scale[1] = scale[16 * warp + (lane >> 2) + 8]
        cuda.syncthreads()
        q_s32 = cuda.shared.array(0, uint32)[0:M * S // 2]
        tiles.scale_rows(o, row_scale)
        tiles.stage_accumulator(q_s32, o, 16 * warp, lane, S, swizzle, elem)
        cuda.syncthreads()
        tiles.store_tile(o32, q_s32, 0, M - 3, M, d, S, swizzle, tid, THREADS)

    return kernel, 2 * (M + 2 * n) * S


@pytest.mark.parametrize("dtype, swizzle, d", [
    ("bfloat16", True, 64), ("bfloat16", False, 64), ("float16", True, 64), ("float16", False, 64),
    # head dims whose 12 and 6 chunks a row do not divide the 64 threads: copies and stores dealt
    # out in row-major order (tiles.split_by_columns), padded rows
    ("bfloat16", False, 96), ("float16", False, 48)])
def test_accumulator_as_next_operand_and_staged_store(rng, dtype, swizzle, d):
    n = 32
    q = inputs.random_qkv(rng, 1, M, 1, d, dtype)[0].reshape(M, d)
    k = (inputs.random_qkv(rng, 1, n, 1, d, dtype)[0].reshape(n, d).astype(np.float32) / 8).astype(q.dtype)
    v = inputs.random_qkv(rng, 1, n, 1, d, dtype)[0].reshape(n, d)
    scale = rng.uniform(0.5, 2, M).astype(np.float32)
    o = np.full((M, d), np.nan, np.float32).astype(q.dtype)
    kernel, smem = chain_kernel(d, n, swizzle, elements.element(dtype).code)
    kernel[1, THREADS, 0, smem](q.view(np.uint16), k.view(np.uint16), v.view(np.uint16), scale,
                               o.view(np.uint32))
    f = lambda x: x.astype(np.float64)  # noqa: E731
    s = f(q) @ f(k).T
    p = s.astype(np.float32).astype(q.dtype)                     # P rounded to the dtype, in registers
    exact = f(p) @ f(v) * scale[:, None]
    # The kernel rounds P from an fp32 S, NumPy from a float64 S: near a rounding boundary the two
    # round one element of P differently by one ulp (u |P|), which moves O by up to u |P| |V|.
    # Bound: that, plus O's own rounding to the dtype.
    u = sem_eps(dtype)
    bound = 2 * u * np.abs(exact) + 2 * u * (np.abs(f(p)) @ np.abs(f(v))) * scale[:, None]
    rows = M - 3                                                 # store_tile skips rows >= n_rows
    err = np.abs(f(o[:rows]) - exact[:rows])
    assert (err <= bound[:rows]).all(), f"max excess {np.max(err - bound[:rows]):.3g}"
    assert np.isnan(f(o[rows:])).all()


def sem_eps(dtype):
    return {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[dtype]


def test_tile_copy_split_is_checked():
    tiles.check_tile_copy(64, 128, 128)
    tiles.check_tile_copy(64, 96, 128)      # 12 chunks a row: dealt out in row-major order
    with pytest.raises(ValueError, match="does not split"):
        tiles.check_tile_copy(64, 100, 128)
    with pytest.raises(ValueError, match="multiple of 64"):
        tiles.tile_row_stride(96, swizzle=True)
