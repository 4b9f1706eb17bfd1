"""Every PTX intrinsic in a kernel, on the GPU (real instruction) or in the simulator (stand-in).

The expected answers come from the NumPy lane semantics in common/hardware/lanes.py, so on a GPU these
tests check each instruction against its stand-in; the lane semantics themselves are checked here
against the PTX ISA's fragment tables, written out independently as loops.
"""
import numpy as np
import pytest
from numba import cuda, float32, int32, uint16, uint32

from common.hardware import elements, ptx, sm90, target
from common.hardware import lanes as sem
from experiments.measure import inputs
from tests.conftest import ON_GPU

DTYPES = ["bfloat16", "float16"]


def random_halves(rng, shape, dtype):
    return inputs.random_qkv(rng, 1, 1, 1, int(np.prod(shape)), dtype)[0].reshape(shape).view(np.uint16)


def regs_from_halves(halves):
    """(32, 2r) uint16 -> (32, r) uint32, low half first."""
    return np.ascontiguousarray(halves).view(np.uint32)


# ----------------------------------------------------------------- the lane semantics vs the ISA


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_lane_semantics_match_the_isa_tables(rng, dtype):
    a = sem.halves_to_float(random_halves(rng, (16, 16), dtype), dtype)
    b = sem.halves_to_float(random_halves(rng, (16, 8), dtype), dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a_bits, b_bits = sem.float_to_halves(a, dtype), sem.float_to_halves(b, dtype)
    a_regs = np.zeros((32, 4), np.uint32)
    b_regs = np.zeros((32, 2), np.uint32)
    c_regs = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        # PTX ISA 9.7.14.5.8, m16n8k16 .f16/.bf16: a_i = (row, col), (row, col+1)
        for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            a_regs[lane, i] = int(a_bits[row, col]) | int(a_bits[row, col + 1]) << 16
        for i, k in enumerate([2 * t, 2 * t + 8]):
            b_regs[lane, i] = int(b_bits[k, g]) | int(b_bits[k + 1, g]) << 16
        for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            c_regs[lane, i] = c[row, col]
    d_regs = sem.mma_lanes(a_regs, b_regs, c_regs, dtype)
    d = a @ b + c
    for lane in range(32):
        g, t = lane // 4, lane % 4
        expect = [d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]]
        np.testing.assert_allclose(d_regs[lane], expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_lane_semantics(rng, trans):
    smem = rng.integers(0, 2**16, 4096, dtype=np.uint16)
    offsets = rng.choice(4096 // 8, 32, replace=False) * 8
    regs = sem.ldmatrix_lanes(smem, offsets, trans)
    for i in range(4):
        m = np.stack([smem[offsets[8 * i + r]:offsets[8 * i + r] + 8] for r in range(8)])
        if trans:
            m = m.T
        for lane in range(32):   # an 8x8 b16 matrix fragment: row lane/4, columns 2(lane%4), +1
            row, col = lane // 4, 2 * (lane % 4)
            assert regs[lane, i] == int(m[row, col]) | int(m[row, col + 1]) << 16


def test_stmatrix_lane_semantics(rng):
    """stmatrix.x4 writes what ldmatrix.x4 (no .trans) reads back, and row lane/4, columns
    2(lane%4), +1 of matrix i come from register i of lane (the PTX ISA's figure for stmatrix)."""
    offsets = rng.choice(4096 // 8, 32, replace=False) * 8
    regs = rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    smem = np.zeros(4096, np.uint16)
    sem.stmatrix_lanes(smem, offsets, regs)
    np.testing.assert_array_equal(sem.ldmatrix_lanes(smem, offsets, False), regs)
    for i in range(4):
        for lane in range(32):
            row = offsets[8 * i + lane // 4]
            col = 2 * (lane % 4)
            assert int(smem[row + col]) | int(smem[row + col + 1]) << 16 == regs[lane, i]


# ----------------------------------------------------------------- the intrinsics in kernels

@cuda.jit
def mma_kernel(a, b, c, d, elem):
    lane = cuda.threadIdx.x
    if elem == elements.BF16:
        r = ptx.mma_bf16_16816(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                               c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    else:
        r = ptx.mma_f16_16816(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                              c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for j in range(4):
        d[lane, j] = r[j]


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma(rng, dtype):
    a = regs_from_halves(random_halves(rng, (32, 8), dtype))
    b = regs_from_halves(random_halves(rng, (32, 4), dtype))
    c = rng.standard_normal((32, 4)).astype(np.float32)
    d = np.full((32, 4), np.nan, np.float32)
    mma_kernel[1, 32](a, b, c, d, elements.element(dtype).code)
    np.testing.assert_allclose(d, sem.mma_lanes(a, b, c, dtype), rtol=1e-5, atol=1e-5)


@cuda.jit
def ldmatrix_kernel(src, offsets, out, trans):
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(4096, uint16)
    for i in range(lane, 4096, 32):
        smem[i] = src[i]
    cuda.syncthreads()
    if trans:
        r = ptx.ldmatrix_x4_trans(smem, offsets[lane])
    else:
        r = ptx.ldmatrix_x4(smem, offsets[lane])
    for j in range(4):
        out[lane, j] = r[j]


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix(rng, trans):
    src = rng.integers(0, 2**16, 4096, dtype=np.uint16)
    offsets = (rng.choice(4096 // 8, 32, replace=False) * 8).astype(np.int32)
    out = np.zeros((32, 4), np.uint32)
    ldmatrix_kernel[1, 32](src, offsets, out, trans)
    np.testing.assert_array_equal(out, sem.ldmatrix_lanes(src, offsets, trans))


@cuda.jit
def stmatrix_kernel(regs, offsets, out):
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(4096, uint16)
    for i in range(lane, 4096, 32):
        smem[i] = 0
    cuda.syncthreads()
    sm90.stmatrix_x4(smem, offsets[lane], regs[lane, 0], regs[lane, 1], regs[lane, 2], regs[lane, 3])
    cuda.syncthreads()
    for i in range(lane, 4096, 32):
        out[i] = smem[i]


@pytest.mark.gpu
def test_stmatrix(rng):
    """The instruction against its lane semantics (sm_90: the lent GPUs are Hopper); in the
    simulator the stand-in is those semantics, hence GPU-only."""
    regs = rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    offsets = (rng.choice(4096 // 8, 32, replace=False) * 8).astype(np.int32)
    out = np.zeros(4096, np.uint16)
    stmatrix_kernel[1, 32](regs, offsets, out)
    want = np.zeros(4096, np.uint16)
    sem.stmatrix_lanes(want, offsets, regs)
    np.testing.assert_array_equal(out, want)


@cuda.jit
def prmt_kernel(a, b, selectors, out):
    lane = cuda.threadIdx.x
    out[lane] = ptx.prmt(a[lane], b[lane], selectors[lane])


def test_prmt(rng):
    """prmt.b32: result byte i is byte selector[i] & 7 of b:a (a's bytes 0-3, b's 4-7), or with
    bit 3 of the nibble set that byte's sign bit replicated (0x00 or 0xFF)."""
    a, b = (rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    picks = rng.integers(0, 16, (32, 4))   # bit 3 of a nibble: the byte's sign bit, replicated
    selectors = (picks << (4 * np.arange(4))).sum(1).astype(np.uint32)
    out = np.zeros(32, np.uint32)
    prmt_kernel[1, 32](a, b, selectors, out)
    both = np.concatenate([a.view(np.uint8).reshape(32, 4), b.view(np.uint8).reshape(32, 4)], 1)
    chosen = np.take_along_axis(both, picks & 7, 1)
    chosen = np.where(picks >= 8, np.where(chosen >= 128, 255, 0), chosen).astype(np.uint8)
    want = chosen.copy().view(np.uint32)[:, 0]
    np.testing.assert_array_equal(out, want)


@cuda.jit
def shfl_kernel(x, out, mask):
    lane = cuda.threadIdx.x
    out[lane] = ptx.shfl_xor_f32(x[lane], mask)


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16])
def test_shfl_xor(rng, mask):
    x = rng.standard_normal(32).astype(np.float32)
    out = np.zeros(32, np.float32)
    shfl_kernel[1, 32](x, out, mask)
    np.testing.assert_array_equal(out, x[np.arange(32) ^ mask])


@cuda.jit
def shfl_u32_kernel(x, out, mask):
    lane = cuda.threadIdx.x
    out[lane] = ptx.shfl_xor_u32(x[lane], mask)


@pytest.mark.parametrize("mask", [1, 4, 16])
def test_shfl_xor_u32(rng, mask):
    """Bits, not values: every 32-bit pattern (NaN ones among them as floats) arrives unchanged."""
    x = rng.integers(0, 1 << 32, 32, dtype=np.uint64).astype(np.uint32)
    x[:2] = (0x7FC00001, 0xFFFFFFFF)
    out = np.zeros(32, np.uint32)
    shfl_u32_kernel[1, 32](x, out, mask)
    np.testing.assert_array_equal(out, x[np.arange(32) ^ mask])


@cuda.jit
def math_kernel(x, e, lo, hi, bf, hf):
    i = cuda.threadIdx.x
    e[i] = ptx.ex2_approx(x[i])
    bf[i] = ptx.pack_bf16x2(lo[i], hi[i])
    hf[i] = ptx.pack_f16x2(lo[i], hi[i])


def test_ex2_and_packing(rng):
    x = (rng.standard_normal(64) * 20).astype(np.float32)
    x[:3] = [-np.inf, 0.0, -150.0]
    lo, hi = (rng.standard_normal(64).astype(np.float32) * 100 for _ in range(2))
    e, bf, hf = np.zeros(64, np.float32), np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    math_kernel[1, 64](x, e, lo, hi, bf, hf)
    np.testing.assert_allclose(e, np.exp2(x.astype(np.float64)), rtol=2e-6, atol=1e-30)
    for packed, dtype in ((bf, "bfloat16"), (hf, "float16")):
        expect = (sem.float_to_halves(lo, dtype).astype(np.uint32)
                  | sem.float_to_halves(hi, dtype).astype(np.uint32) << 16)
        np.testing.assert_array_equal(packed, expect)


@cuda.jit
def ex2_poly_kernel(x, e):
    i = cuda.grid(1)
    if i < x.shape[0]:
        e[i] = ptx.ex2_poly(x[i])


def test_ex2_poly_is_its_lane_semantics_and_within_its_error_of_exp2(rng):
    """ptx.ex2_poly (2^x on the FMA units) against lanes.ex2_poly, which it must match within an
    ulp (NumPy's float64 stands in for each fused multiply-add's single rounding), and both
    against float64 exp2 within the polynomial's relative error on the range the softmax uses
    (every input at most FP8's shift of 8; -inf and anything below -127 give exactly 0)."""
    x = np.concatenate([rng.uniform(-140, 8, 4000), np.arange(-130, 9)]).astype(np.float32)
    x[:4] = [-np.inf, 0.0, 8.0, -126.0]
    e = np.zeros_like(x)
    ex2_poly_kernel[(x.size + 127) // 128, 128](x, e)
    spec = sem.ex2_poly(x)
    ulps = np.abs(e.view(np.int32).astype(np.int64) - spec.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1, (x[ulps.argmax()], e[ulps.argmax()], spec[ulps.argmax()])
    exact = np.exp2(x.astype(np.float64))
    normal = x >= -126
    assert (np.abs(spec[normal] - exact[normal]) <= sem.EX2_POLY_REL_ERROR * exact[normal]).all()
    assert (spec[x < -126] == 0).all() and (e[x < -126] == 0).all()
    assert spec[1] == e[1] == 1.0 and spec[2] == e[2] == 256.0


@cuda.jit
def unpack_kernel(words, bf, hf):
    i = cuda.threadIdx.x
    bf[i, 0], bf[i, 1] = ptx.unpack_bf16x2(words[i])
    hf[i, 0], hf[i, 1] = ptx.unpack_f16x2(words[i])


def test_unpacking_inverts_packing(rng):
    halves = rng.integers(0, 2**16, (64, 2), dtype=np.uint16)
    # No NaN/inf patterns (exponent all ones in either format): they need not round-trip bitwise,
    # and converting them warns. Masked on the bits, so nothing non-finite is ever converted.
    for exponent in (0x7F80, 0x7C00):       # bfloat16, float16
        halves[(halves & exponent) == exponent] = 0
    words = np.ascontiguousarray(halves).view(np.uint32)[:, 0]
    bf, hf = np.zeros((64, 2), np.float32), np.zeros((64, 2), np.float32)
    unpack_kernel[1, 64](words, bf, hf)
    np.testing.assert_array_equal(bf, sem.halves_to_float(halves, "bfloat16").astype(np.float32))
    np.testing.assert_array_equal(hf, sem.halves_to_float(halves, "float16").astype(np.float32))


@cuda.jit
def copy_kernel(src, out32, dst, valid_rows):
    """cp.async each 16-byte chunk of src into shared memory (rows >= valid_rows zero-filled), from
    row 0's address moved by whole row pitches, then ld.shared.v4 / st.global.v4 it back out."""
    tid = int32(cuda.threadIdx.x)
    smem = cuda.shared.array(0, uint16)
    row, col = tid // 4, (tid % 4) * 8
    inside = row < valid_rows
    first = ptx.global_address(src, 0, col)
    ptx.cp_async_16_from(smem, tid * 8, first + row * src.strides[0] if inside else first,
                         16 if inside else 0)
    ptx.cp_async_commit()
    ptx.cp_async_wait(0)
    cuda.syncthreads()
    smem32 = cuda.shared.array(0, uint32)
    x = ptx.ld_shared_v4_u32(smem32, tid * 4)
    ptx.st_global_v4_u32(dst, row, col // 2, x[0], x[1], x[2], x[3])
    out32[tid] = x[0]


def test_async_copy_and_vector_access(rng):
    src = rng.integers(0, 2**16, (16, 32), dtype=np.uint16)
    dst = np.zeros((16, 16), np.uint32)
    out32 = np.zeros(64, np.uint32)
    copy_kernel[1, 64, 0, 16 * 32 * 2](src, out32, dst, 11)
    expect = src.copy()
    expect[11:] = 0
    np.testing.assert_array_equal(dst.view(np.uint16), expect)
    np.testing.assert_array_equal(out32, expect.reshape(64, 8).view(np.uint32)[:, 0])


@cuda.jit
def vector_load_kernel(src, dst):
    """Thread t loads words 4 (t % 4) .. + 3 of key t // 4 of every (b, h) of a (B, N, H, words)
    view with ld.global.v4 and stores them as they came."""
    tid = int32(cuda.threadIdx.x)
    b, h = int32(cuda.blockIdx.x), int32(cuda.blockIdx.y)
    key, col = tid // 4, 4 * (tid % 4)
    x = ptx.ld_global_v4_u32(src, b, key, h, col)
    for w in range(4):
        dst[b, h, key, col + w] = x[w]


def test_global_vector_load_of_a_strided_view(rng):
    """ld_global_v4_u32 on a 4-D view that is not contiguous: rows of 16 words 80 bytes apart (a
    padded pitch), as fp8.v_k_major reads V (B, N, H, d) by (b, key, h)."""
    buf = rng.integers(0, 2**32, (2, 8, 3, 20), dtype=np.uint32)   # (B, N, H, words + pad)
    dst = np.zeros((2, 3, 8, 16), np.uint32)
    vector_load_kernel[(2, 3), 32](cuda.to_device(buf)[:, :, :, :16], dst)
    np.testing.assert_array_equal(dst, buf[..., :16].transpose(0, 2, 1, 3))


@cuda.jit
def store_shared_kernel(out):
    """Each thread stores a word into the mirrored slot with st.shared; the block reads them back."""
    tid = int32(cuda.threadIdx.x)
    smem32 = cuda.shared.array(64, uint32)
    ptx.st_shared_u32(smem32[32:], 31 - tid, uint32(3 * tid + 1))
    ptx.st_shared_u32(smem32, tid, uint32(7))
    cuda.syncthreads()
    out[tid] = smem32[32 + tid] + smem32[tid]


def test_shared_store_writes_the_word_at_the_offset():
    out = np.zeros(32, np.uint32)
    store_shared_kernel[1, 32](out)
    np.testing.assert_array_equal(out, 3 * (31 - np.arange(32)) + 1 + 7)


@cuda.jit
def reduce_kernel(dst):
    """Every thread of every block adds (block + 1, thread) to one pair of columns of dst."""
    tid, blk = int32(cuda.threadIdx.x), int32(cuda.blockIdx.x)
    ptx.red_add_v2_f32(dst, tid % 4, 2 * ((tid // 4) % 4), float32(blk + 1), float32(tid))


def test_vector_reduction_adds_both_columns_atomically():
    blocks, threads = 6, 128
    dst = np.zeros((4, 8), np.float32)
    reduce_kernel[blocks, threads](dst)
    expect = np.zeros((4, 8))
    for b in range(blocks):                  # small integers: every order of the adds is exact
        for t in range(threads):
            row, col = t % 4, 2 * ((t // 4) % 4)
            expect[row, col] += b + 1
            expect[row, col + 1] += t
    np.testing.assert_array_equal(dst, expect.astype(np.float32))


@cuda.jit
def reduce_at_kernel(dst):
    """The same adds through red_add_v2_f32_at: the address of dst[0, 2] computed once, moved by
    whole row pitches, plus a column offset."""
    tid, blk = int32(cuda.threadIdx.x), int32(cuda.blockIdx.x)
    base = ptx.global_address(dst, int32(0), int32(2))
    row, col = tid % 4, 2 * ((tid // 4) % 3)
    ptx.red_add_v2_f32_at(base + row * dst.strides[0], col, float32(blk + 1), float32(tid))


def test_vector_reduction_at_an_address_plus_rows_and_columns():
    blocks, threads = 6, 96
    dst = np.zeros((4, 8), np.float32)
    reduce_at_kernel[blocks, threads](dst)
    expect = np.zeros((4, 8))
    for b in range(blocks):
        for t in range(threads):
            row, col = t % 4, 2 + 2 * ((t // 4) % 3)
            expect[row, col] += b + 1
            expect[row, col + 1] += t
    np.testing.assert_array_equal(dst, expect.astype(np.float32))


@cuda.jit
def bulk_reduce_kernel(dst):
    """Each block fills 64 floats of shared memory with 16-byte stores and thread 0 adds them into
    rows 1 and 2 of dst with one bulk reduction (every block into the same floats)."""
    tid, blk = int32(cuda.threadIdx.x), int32(cuda.blockIdx.x)
    smem = cuda.shared.array(0, float32)
    x = 4 * tid
    ptx.st_shared_v4_f32(smem, x, float32((blk + 1) * (x + 1)), float32((blk + 1) * (x + 2)),
                         float32((blk + 1) * (x + 3)), float32((blk + 1) * (x + 4)))
    ptx.fence_proxy_async_shared()
    cuda.syncthreads()
    if tid == 0:
        ptx.bulk_reduce_add_f32(dst, 1, smem, 0, 256)
        ptx.bulk_commit()
        ptx.bulk_wait_read(0)
        ptx.bulk_wait(0)


def test_bulk_reduction_adds_a_contiguous_block():
    blocks = 5
    dst = np.full((4, 32), 0.5, np.float32)
    bulk_reduce_kernel[blocks, 16, 0, 256](dst)
    expect = np.full((4, 32), 0.5)
    expect[1:3] += (np.arange(64) + 1).reshape(2, 32) * sum(b + 1 for b in range(blocks))
    np.testing.assert_array_equal(dst, expect.astype(np.float32))   # small integers: exact


@cuda.jit
def bulk_store_kernel(dst, rows):
    """Shared memory filled (word w = 1000 blk + w, four 4-byte stores a thread), then thread 0
    copies `rows` rows of 32 words into rows blk, blk + 2, ... of dst (uint32), a bulk copy a
    row."""
    tid, blk = int32(cuda.threadIdx.x), int32(cuda.blockIdx.x)
    smem = cuda.shared.array(0, uint32)
    x = 4 * tid
    base = uint32(1000 * blk)
    for i in range(4):
        smem[x + i] = base + uint32(x + i)
    ptx.fence_proxy_async_shared()
    cuda.syncthreads()
    if tid == 0:
        for r in range(rows):
            ptx.bulk_store(ptx.global_address(dst, blk, int32(0)) + 2 * r * dst.strides[0],
                           smem, int32(32 * r), 128)
        ptx.bulk_commit()
        ptx.bulk_wait_read(0)
        ptx.bulk_wait(0)


def test_bulk_store_copies_whole_rows():
    """ptx.bulk_store (fa3's o_store="bulk"): rows of 128 bytes from shared memory, each into a
    row of a strided destination (every other row: the rows between stay as they were)."""
    dst = np.full((6, 40), 7, np.uint32)   # rows longer than a copy: its tail stays too
    bulk_store_kernel[2, 16, 0, 256](dst, 2)
    expect = np.full((6, 40), 7, np.uint32)
    for blk in range(2):
        for r in range(2):
            expect[blk + 2 * r, :32] = 1000 * blk + 32 * r + np.arange(32)
    np.testing.assert_array_equal(dst, expect)


@cuda.jit
def pair_barrier_kernel(out, spin):
    """Warps 2p and 2p+1 meet at named barrier 1 + p: the first spins, then writes its lanes' ids
    to shared memory; after the barrier the second reads them (and the first the second's)."""
    tid = int32(cuda.threadIdx.x)
    warp, lane = tid >> 5, tid & 31
    smem = cuda.shared.array(128, int32)
    x = int32(0)
    if warp % 2 == 0:
        for i in range(spin[0]):        # a slow writer: without the barrier its partner reads early
            x = x * int32(1103515245) + int32(12345)
    smem[tid] = 1000 * warp + lane
    ptx.bar_sync(1 + (warp >> 1), 64)
    out[tid] = smem[tid ^ 32]
    if tid == 0:
        out[128] = x                    # keeps the spin


def test_named_barrier_orders_a_pair_of_warps():
    out = np.full(129, -1, np.int32)
    pair_barrier_kernel[1, 128](out, np.array([20000 if ON_GPU else 1], np.int32))
    partner = np.arange(128) ^ 32
    np.testing.assert_array_equal(out[:128], 1000 * (partner // 32) + partner % 32)


# ----------------------------------------------------------------- the simulator's cp.async model
# In the simulator a cp.async copy lands at the cp_async_wait that covers it, not before (on a GPU:
# at some time up to it), and a kernel (common.hardware.target.kernel) whose thread returns with copies in
# flight is refused. Each thread copies row `tid` of src into its own 8 halves of shared memory,
# which start as MARK.

MARK = 0xABCD


@cuda.jit
def async_groups_kernel(src, seen):
    """seen[s, tid]: the first half of each of this thread's three slots at stage s. Copy A is
    committed alone, B after it, C is issued but not committed until stage 3; stages: 0 before
    any wait, 1 after wait(1) (A lands), 2 after wait(0) (B lands; C is in no group), 3 after
    commit and wait(0) (C lands, zero-filled)."""
    tid = int32(cuda.threadIdx.x)
    smem = cuda.shared.array(3 * 256, uint16)
    for slot in range(3):
        for e in range(8):
            smem[slot * 256 + tid * 8 + e] = MARK
    ptx.cp_async_16(smem, tid * 8, src, tid, 0, 16)           # A
    ptx.cp_async_commit()
    ptx.cp_async_16(smem, 256 + tid * 8, src, tid, 8, 16)     # B
    ptx.cp_async_commit()
    ptx.cp_async_16(smem, 512 + tid * 8, src, tid, 0, 0)      # C: zero-fill
    for slot in range(3):
        seen[0, slot, tid] = smem[slot * 256 + tid * 8]
    ptx.cp_async_wait(1)
    for slot in range(3):
        seen[1, slot, tid] = smem[slot * 256 + tid * 8]
    ptx.cp_async_wait(0)
    for slot in range(3):
        seen[2, slot, tid] = smem[slot * 256 + tid * 8]
    ptx.cp_async_commit()
    ptx.cp_async_wait(0)
    for slot in range(3):
        seen[3, slot, tid] = smem[slot * 256 + tid * 8]


@pytest.mark.sim
def test_async_copies_land_only_at_the_wait_that_covers_them(rng):
    src = rng.integers(0, MARK, (32, 16), dtype=np.uint16)
    seen = np.zeros((4, 3, 32), np.uint16)
    async_groups_kernel[1, 32](src, seen)
    a, b, mark, zero = src[:, 0], src[:, 8], np.full(32, MARK), np.zeros(32)
    expect = [[mark, mark, mark], [a, mark, mark], [a, b, mark], [a, b, zero]]
    np.testing.assert_array_equal(seen, np.array(expect, np.uint16))


@target.kernel
def bulk_store_restaged_kernel(dst, wait_before_restage, wait_at_end):
    """Thread 0 bulk-stores 16 words of 1s from shared memory, which is then restaged with 2s;
    its waits for the copy: before the restaging, at the end, or none."""
    tid = int32(cuda.threadIdx.x)
    smem = cuda.shared.array(0, uint32)
    for i in range(4):
        smem[4 * tid + i] = uint32(1)
    ptx.fence_proxy_async_shared()
    cuda.syncthreads()
    if tid == 0:
        ptx.bulk_store(ptx.global_address(dst, 0, int32(0)), smem, 0, 64)
        ptx.bulk_commit()
        if wait_before_restage:
            ptx.bulk_wait_read(0)
    cuda.syncthreads()
    for i in range(4):
        smem[4 * tid + i] = uint32(2)
    cuda.syncthreads()
    if tid == 0 and wait_at_end:
        ptx.bulk_wait(0)


@pytest.mark.sim
def test_simulated_bulk_stores_read_their_source_at_the_wait():
    """The simulator lands a bulk store at the latest a GPU may read its source, the bulk wait
    that covers it: a source restaged before that wait is what gets copied (on a GPU, a race),
    and a kernel that never waits is refused."""
    for before, expect in ((True, 1), (False, 2)):
        dst = np.zeros((2, 16), np.uint32)
        bulk_store_restaged_kernel[1, 4, 0, 64](dst, before, True)
        np.testing.assert_array_equal(dst[0], np.full(16, expect, np.uint32))
        assert not dst[1].any()
    with pytest.raises(RuntimeError, match="bulk stores issued but never waited for"):
        bulk_store_restaged_kernel[1, 4, 0, 64](np.zeros((2, 16), np.uint32), False, False)


@target.kernel
def unwaited_copy_kernel(src, commit):
    """Issues a copy and returns without waiting for it (committed or not)."""
    tid = int32(cuda.threadIdx.x)
    smem = cuda.shared.array(256, uint16)
    ptx.cp_async_16(smem, tid * 8, src, tid, 0, 16)
    if commit:
        ptx.cp_async_commit()


@target.kernel
def waited_copy_kernel(src, out):
    tid = int32(cuda.threadIdx.x)
    smem = cuda.shared.array(256, uint16)
    ptx.cp_async_16(smem, tid * 8, src, tid, 0, 16)
    ptx.cp_async_commit()
    ptx.cp_async_wait(0)
    out[tid] = smem[tid * 8]


@pytest.mark.sim
@pytest.mark.parametrize("commit", [True, False])
def test_a_kernel_returning_with_copies_in_flight_is_refused(commit):
    src = np.arange(32 * 8, dtype=np.uint16).reshape(32, 8)
    with pytest.raises(RuntimeError, match=r"cp\.async copies issued but never waited for "
                                           r"\(cp_async_wait\) before the kernel returned"):
        unwaited_copy_kernel[1, 32](src, commit)
    out = np.zeros(32, np.uint16)
    waited_copy_kernel[1, 32](src, out)     # the same copy, waited for: accepted
    np.testing.assert_array_equal(out, src[:, 0])
    assert waited_copy_kernel.py_func.__wrapped__.__name__ == "waited_copy_kernel"
