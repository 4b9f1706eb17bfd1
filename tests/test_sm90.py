"""The Hopper instructions of common/hardware/sm90.py against NumPy, on the GPU (the real wgmma, TMA and
mbarriers) and in the simulator (their stand-ins): one kernel loads A (64 x d), B (n x d) and
V with bulk tensor copies onto one mbarrier, computes S = A B^T with SS-wgmma (both operands
through 128-byte-swizzle descriptors) and O = P~ V with RS-wgmma (P~ = S rounded and re-packed as
the A operand in registers), and writes both accumulators out by the fragment layout of sm90's
header. 16-bit: V read transposed (MN-major); e4m3 (k32): V^T K-major, keys in fp8.KEY_ORDER, P~
by tiles.accumulator_to_a_e4m3. A wrong descriptor field (LBO, SBO, swizzle), fragment order,
key order or transpose gives a wrong S or O."""
import numpy as np
import pytest
from numba import cuda, float32, int32, uint16, uint32

from common.hardware import lanes as sem
from common.hardware import ptx, sm80, sm90
from common.hardware.target import device_function
from common.host import arrays, tensormaps
from common.host.launching import launch
from common.tile import tiles
from tests.conftest import ON_GPU
from tests.test_ptx import random_halves
from variants import fp8

CASES = [(64, 64, "bfloat16"), (128, 128, "float16"), (128, 128, "e4m3"), (128, 64, "bfloat16"),
         (64, 256, "bfloat16"), (128, 256, "e4m3"), (256, 128, "e4m3")]
if not ON_GPU:
    CASES = CASES[:3]
PTX_TYPE = {"bfloat16": "bf16", "float16": "f16", "e4m3": "e4m3"}


@device_function
def tma_tiles(smem, tmaps, n_maps, tid):
    """The tiles' first 16-bit offset (1024-byte aligned, past 1 KB for mbarriers); mbarrier 0
    made (one arrival) and seen by every thread, thread 0's n_maps tensor maps acquired."""
    base = sm90.shared_address(smem, 0)
    t0 = int32(((base + uint32(1024 + 127)) & uint32(0xFFFFFC00)) - base) >> 1
    if tid == 0:
        sm90.mbarrier_init(smem, 0, 1)
        sm90.fence_mbarrier_init()
    cuda.syncthreads()
    if tid == 0:
        for m in range(n_maps):
            sm90.tensormap_acquire(tmaps, m)
    return t0


def build_gemm_kernel(d, n, dtype):
    """16-bit: V (n x d) read transposed (MN-major, d/64 panels); e4m3: V^T (d x n, K-major, n/128
    panels of 128 keys, keys in fp8.KEY_ORDER) and P~ re-packed by accumulator_to_a_e4m3."""
    fp8_ = dtype == "e4m3"
    eb = 1 if fp8_ else 2
    panel = 128 // eb                          # columns of a 128-byte row
    kq, kp = d * eb // 32, n // (32 if fp8_ else 16)   # k-steps of S = A B^T and of O = P V
    mma_s = sm90.wgmma_ss(n, PTX_TYPE[dtype])
    mma_o = sm90.wgmma_rs(d, PTX_TYPE[dtype], not fp8_)
    wait_s, wait_o = sm90.wgmma_wait(0, n // 2), sm90.wgmma_wait(0, d // 2)
    a_elems, b_elems = 64 * d * eb // 2, n * d * eb // 2     # 16-bit units
    s_shape, o_shape, p_shape = (1, n // 8, 4), (1, d // 8, 4), (1, kp, 4)
    total = 2 * (a_elems + 2 * b_elems)
    v_panels, v_rows = (n // 128, d) if fp8_ else (d // 64, n)

    @cuda.jit
    def gemm(tmaps, s_out, o_out):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        smem = cuda.shared.array(0, uint16)
        t0 = tma_tiles(smem, tmaps, 3, tid)
        if tid == 0:
            sm90.mbarrier_arrive_expect_tx(smem, 0, total)
            for p in range(d // panel):
                sm90.tma_load_4d(smem, t0 + p * 64 * 64, tmaps, 0, p * panel, 0, 0, 0, smem, 0)
                sm90.tma_load_4d(smem, t0 + a_elems + p * n * 64, tmaps, 1, p * panel, 0, 0, 0,
                                 smem, 0)
            for p in range(v_panels):
                sm90.tma_load_4d(smem, t0 + a_elems + b_elems + p * v_rows * 64, tmaps, 2,
                                 p * panel, 0, 0, 0, smem, 0)
        sm90.mbarrier_wait(smem, 0, 0)
        # each operand's descriptor built once and advanced a k-step, as fa3 does
        a_desc = sm90.smem_descriptor(sm90.shared_address(smem, t0), 16, 1024)
        b_desc = sm90.smem_descriptor(sm90.shared_address(smem, t0 + a_elems), 16, 1024)
        v_desc = sm90.smem_descriptor(sm90.shared_address(smem, t0 + a_elems + b_elems),
                                      16 if fp8_ else n * 128, 1024)
        s = cuda.local.array(s_shape, float32)
        o = cuda.local.array(o_shape, float32)
        p_frag = cuda.local.array(p_shape, uint32)
        tiles.fill(o, float32(0))
        sm90.wgmma_fence()
        for kk in range(kq):
            mma_s(s, sm90.descriptor_advance(a_desc, (kk >> 2) * 64 * 128 + (kk & 3) * 32),
                  sm90.descriptor_advance(b_desc, (kk >> 2) * n * 128 + (kk & 3) * 32), kk)
        sm90.wgmma_commit()
        wait_s(s)
        if fp8_:
            tiles.accumulator_to_a_e4m3(p_frag, s)
        else:
            tiles.accumulator_to_a(p_frag, s, dtype == "bfloat16")
        sm90.wgmma_fence()
        for kk in range(kp):
            if fp8_:
                desc = sm90.descriptor_advance(v_desc, (kk >> 2) * d * 128 + (kk & 3) * 32)
            else:
                desc = sm90.descriptor_advance(v_desc, kk * 16 * 128)
            mma_o(o, p_frag[0, kk, 0], p_frag[0, kk, 1], p_frag[0, kk, 2], p_frag[0, kk, 3], desc, 1)
        sm90.wgmma_commit()
        wait_o(o)
        for c in range(n // 8):
            for j in range(4):
                r, col = tiles.accumulator_position(0, c, j, lane)
                s_out[16 * warp + r, col] = s[0, c, j]
        for c in range(d // 8):
            for j in range(4):
                r, col = tiles.accumulator_position(0, c, j, lane)
                o_out[16 * warp + r, col] = o[0, c, j]

    return gemm, 1024 + 128 + 2 * total


def device_view(host, library):
    x = cuda.to_device(host)
    return arrays.bits_view(arrays.describe(x, "x"), host.dtype.type), x


def random_operand(rng, shape, dtype):
    """Bits of random values: 16-bit N(0, 1), or e4m3 N(0, 1) (P~ = e4m3(S) stays in range)."""
    if dtype == "e4m3":
        return sem.float_to_e4m3(rng.standard_normal(shape))
    return random_halves(rng, shape, dtype)


def to_float(bits, dtype):
    return sem.bytes_to_float(bits) if dtype == "e4m3" else sem.halves_to_float(bits, dtype)


@pytest.mark.parametrize("d, n, dtype", CASES)
def test_wgmma_on_tma_tiles_matches_numpy(rng, d, n, dtype):
    a = random_operand(rng, (64, d), dtype)
    b = random_operand(rng, (n, d), dtype)
    v = random_operand(rng, (n, d), dtype)
    if dtype == "e4m3":   # V^T, each 16 keys in the order P~'s A registers hold them
        order = np.concatenate([16 * g + fp8.KEY_ORDER for g in range(n // 16)])
        v_op, v_box = np.ascontiguousarray(v[order].T), (d, 128)
        box = 128
    else:
        v_op, v_box, box = v, (n, 64), 64
    views = [device_view(x.reshape(1, 1, *x.shape), None) for x in (a, b, v_op)]
    tmaps = tensormaps.tensor_maps(((views[0][0], 64, box), (views[1][0], n, box),
                                    (views[2][0], *v_box)))
    s_view, s_dev = device_view(np.full((64, n), np.nan, np.float32), None)
    o_view, o_dev = device_view(np.full((64, d), np.nan, np.float32), None)
    kern, smem = build_gemm_kernel(d, n, dtype)
    launch(kern, 1, 128, smem, 0, tmaps, s_view, o_view)
    s_got, o_got = s_dev.copy_to_host(), o_dev.copy_to_host()
    af, bf, vf = (to_float(x, dtype) for x in (a, b, v))
    s_ref = af @ bf.T
    # Hopper's FP8 wgmma adds its products with fewer than fp32's bits (DeepSeek-V3 measured ~14):
    # e4m3 results are held to 2^-10 of the sum of |products|, far below what a wrong layout gives
    tol = (lambda x, y: 2.0 ** -10 * (np.abs(x) @ np.abs(y))) if dtype == "e4m3" else \
        (lambda x, y: 1e-5 * np.abs(x @ y).max())
    np.testing.assert_array_less(np.abs(s_got - s_ref), tol(af, bf.T) + 1e-5 * np.abs(s_ref))
    if dtype == "e4m3":   # P~ as the kernel re-packed it
        p = sem.bytes_to_float(sem.float_to_e4m3(s_got))
    else:
        p = sem.halves_to_float(sem.float_to_halves(s_got, dtype), dtype)
    o_ref = p @ vf
    np.testing.assert_array_less(np.abs(o_got - o_ref), tol(p, vf) + 1e-5 * np.abs(o_ref))


RING_MMA, RING_WAIT = sm90.wgmma_ss(64, "bf16"), sm90.wgmma_wait(0, 32)


@cuda.jit
def cp_async_ring_kernel(a, b, s_out, rounds):
    """fa3's cp.async producer in miniature: a producer warp (warp 4) copies A (64 x 64) and round
    r's B (64 x 64, rows 64 r..) with 16-byte cp.async into 128-byte-swizzled tiles of a two-stage
    ring and signals each stage's full mbarrier (count 32) with cp.async.mbarrier.arrive.noinc; the
    consumer warpgroup waits, fences the generic-proxy writes for the async proxy and computes
    S = A B_r^T with SS-wgmma through descriptors, then releases the stage (empty mbarrier)."""
    tid = int32(cuda.threadIdx.x)
    warp, lane = tid >> 5, tid & 31
    smem = cuda.shared.array(0, uint16)
    base = sm90.shared_address(smem, 0)
    t0 = int32(((base + uint32(1024 + 127)) & uint32(0xFFFFFC00)) - base) >> 1
    if tid == 0:
        sm90.mbarrier_init(smem, 0, 32)            # A landed
        for st in range(2):
            sm90.mbarrier_init(smem, 4 + 4 * st, 32)   # stage st full: one arrival a lane
            sm90.mbarrier_init(smem, 12 + 4 * st, 4)   # stage st empty: one a consumer warp
        sm90.fence_mbarrier_init()
    cuda.syncthreads()
    if warp == 4:
        tiles.load_tile_async(smem[t0:t0 + 4096], a, 0, 64, 0, 64, 64, 64, True, lane, 32, False)
        sm90.cp_async_mbarrier_arrive(smem, 0)
        for r in range(rounds[0]):
            st = r & 1
            if r >= 2:
                sm90.mbarrier_wait(smem, 12 + 4 * st, ((r >> 1) - 1) & 1)
            tiles.load_tile_async(smem[t0 + 4096 * (1 + st):t0 + 4096 * (2 + st)], b, 64 * r,
                                  64 * rounds[0], 0, 64, 64, 64, True, lane, 32, False)
            sm90.cp_async_mbarrier_arrive(smem, 4 + 4 * st)
        return
    s = cuda.local.array((1, 8, 4), float32)
    sm90.mbarrier_wait(smem, 0, 0)
    a_desc = sm90.smem_descriptor(sm90.shared_address(smem, t0), 16, 1024)
    for r in range(rounds[0]):
        st = r & 1
        sm90.mbarrier_wait(smem, 4 + 4 * st, (r >> 1) & 1)
        ptx.fence_proxy_async_shared()    # cp.async wrote in the generic proxy; wgmma reads async
        b_desc = sm90.smem_descriptor(sm90.shared_address(smem, t0 + 4096 * (1 + st)), 16, 1024)
        sm90.wgmma_fence()
        for kk in range(4):
            RING_MMA(s, sm90.descriptor_advance(a_desc, kk * 32),
                     sm90.descriptor_advance(b_desc, kk * 32), kk)
        sm90.wgmma_commit()
        RING_WAIT(s)
        if lane == 0:
            sm90.mbarrier_arrive(smem, 12 + 4 * st)
        for c in range(8):
            for j in range(4):
                row, col = tiles.accumulator_position(0, c, j, lane)
                s_out[r, 16 * warp + row, col] = s[0, c, j]


def test_cp_async_copies_signal_an_mbarrier_for_wgmma(rng):
    """cp.async.mbarrier.arrive.noinc (common/hardware/sm90.py): a ring of cp.async tiles read by wgmma, as
    fa3's producer="cp_async" has it (three rounds: the second use of stage 0 waits for its
    release)."""
    rounds = 3
    a = random_halves(rng, (64, 64), "bfloat16")
    b = random_halves(rng, (64 * rounds, 64), "bfloat16")
    s_dev = cuda.to_device(np.full((rounds, 64, 64), np.nan, np.float32))
    cp_async_ring_kernel[1, 160, 0, 1024 + 128 + 3 * 8192](
        cuda.to_device(a), cuda.to_device(b), s_dev, np.array([rounds], np.int32))
    af, bf = (sem.halves_to_float(x, "bfloat16") for x in (a, b))
    ref = np.stack([af @ bf[64 * r:64 * r + 64].T for r in range(rounds)])
    np.testing.assert_allclose(s_dev.copy_to_host(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_descriptor_fields_round_trip():
    """The descriptor's bit fields (the simulator decodes what the GPU reads)."""
    if ON_GPU:
        pytest.skip("host-side check: runs in the simulator")
    desc = int(sm90.smem_descriptor(np.uint32(0x12400 + 96), 16384, 1024))
    assert desc >> 62 == 1
    assert sm90.decode_descriptor(desc) == (0x12400 + 96, 16384, 1024)


def test_descriptor_advance_is_the_descriptor_further_on():
    """descriptor_advance(desc(a), x) == desc(a + x) for addresses up to the top of shared memory
    (on the GPU: the 32-bit add of its inline PTX; in the simulator: the stand-in)."""
    starts = np.array([0x400, 0x12400, 0x30000, 0x37C00], np.uint32)
    steps = np.array([0, 16, 32, 96, 2048, 0x4000, 0x8000 - 16], np.int32)

    @cuda.jit
    def advance(starts, steps, got, want):
        i, j = cuda.grid(2)
        if i < starts.shape[0] and j < steps.shape[0]:
            got[i, j] = sm90.descriptor_advance(sm90.smem_descriptor(starts[i], 16384, 1024), steps[j])
            want[i, j] = sm90.smem_descriptor(starts[i] + uint32(steps[j]), 16384, 1024)

    got = cuda.to_device(np.zeros((len(starts), len(steps)), np.uint64))
    want = cuda.to_device(np.ones((len(starts), len(steps)), np.uint64))
    advance[1, (len(starts), len(steps))](cuda.to_device(starts), cuda.to_device(steps), got, want)
    np.testing.assert_array_equal(got.copy_to_host(), want.copy_to_host())


@pytest.mark.sim
def test_mbarrier_wait_that_cannot_complete_raises(monkeypatch):
    """An expect_tx larger than what the copies deliver hangs a GPU; the stand-in names it."""
    monkeypatch.setattr(sm90, "WAIT_TIMEOUT_S", 0.5)

    @cuda.jit
    def never(flag):
        smem = cuda.shared.array(0, uint16)
        if cuda.threadIdx.x == 0:
            sm90.mbarrier_init(smem, 0, 1)
            sm90.mbarrier_arrive_expect_tx(smem, 0, 128)   # 128 bytes promised, none copied
        cuda.syncthreads()
        sm90.mbarrier_wait(smem, 0, 0)
        flag[0] = 1

    with pytest.raises(RuntimeError, match="transaction bytes missing"):
        never[1, 32, 0, 64](np.zeros(1, np.int32))


@cuda.jit
def handoff_kernel(out, spin):
    """Warp 0 (the producer) spins, stores, then bar.arrive's on named barrier 1; warp 1 bar.sync's
    on it and must see the stores (ping-pong's hand-off between consumer warpgroups in fa3)."""
    tid = int32(cuda.threadIdx.x)
    warp, lane = tid >> 5, tid & 31
    smem = cuda.shared.array(0, uint16)
    words = cuda.shared.array(0, uint32)
    if tid == 0:
        sm90.mbarrier_init(smem, 0, 1)     # warp-specialised (_sim_collectives.independent_groups)
        sm90.fence_mbarrier_init()
    cuda.syncthreads()
    for rnd in range(3):                   # three phases of the same barrier
        if warp == 0:
            x = int32(0)
            for k in range(spin[0]):
                x = (x * 7 + k) & 1023
            words[8 + lane] = uint32(100 * rnd + lane + (x & 0))
            ptx.bar_arrive(1, 64)
        else:
            ptx.bar_sync(1, 64)
            out[rnd, lane] = words[8 + lane]
            ptx.bar_arrive(2, 64)     # warp 0 may overwrite
        if warp == 0:
            ptx.bar_sync(2, 64)


def test_bar_arrive_hands_stores_to_bar_sync():
    out = np.full((3, 32), -1, np.int32)
    handoff_kernel[1, 64, 0, 256](out, np.array([20000 if ON_GPU else 1], np.int32))
    np.testing.assert_array_equal(out, 100 * np.arange(3)[:, None] + np.arange(32)[None, :])


@pytest.mark.sim
def test_named_barrier_that_cannot_complete_raises(monkeypatch):
    """A bar.sync whose partner never arrives hangs a GPU; the stand-in names it."""
    monkeypatch.setattr(sm80, "NAMED_BARRIER_TIMEOUT_S", 0.5)

    @cuda.jit
    def lonely(flag):
        smem = cuda.shared.array(0, uint16)
        if cuda.threadIdx.x == 0:
            sm90.mbarrier_init(smem, 0, 1)
            sm90.fence_mbarrier_init()
        cuda.syncthreads()
        ptx.bar_sync(3, 64)           # 32 threads, 64 expected
        flag[0] = 1

    with pytest.raises(RuntimeError, match="named barrier 3"):
        lonely[1, 32, 0, 64](np.zeros(1, np.int32))


@pytest.mark.sim
def test_a_second_arrival_in_one_phase_raises():
    """Warp 0 bar.arrive's twice on barrier 1 before warp 1 bar.sync's: on a GPU the two arrivals
    complete the phase by themselves and warp 1's sync waits for a third that never comes (the
    hazard fa3's ping-pong had at a tile boundary of its persistent loop); the stand-in names it.
    An arrive and then a sync of the same threads (a phase they complete alone) is allowed."""

    @cuda.jit
    def ahead(flag):
        smem = cuda.shared.array(0, uint16)
        warp = cuda.threadIdx.x >> 5
        if cuda.threadIdx.x == 0:
            sm90.mbarrier_init(smem, 0, 1)
            sm90.fence_mbarrier_init()
        cuda.syncthreads()
        if warp == 0:
            ptx.bar_arrive(2, 64)     # arrive, then sync: the same 32 threads complete phase 0
            ptx.bar_sync(2, 64)
            ptx.bar_arrive(1, 64)
            ptx.bar_arrive(1, 64)
        else:
            x = int32(0)
            for k in range(20000):    # warp 1 late, as a slow consumer warpgroup may be
                x = (x * 7 + k) & 1023
            flag[1] = x
            ptx.bar_sync(1, 64)
        flag[0] = 1

    with pytest.raises(RuntimeError, match="named barrier 1 .* arrived twice in one phase"):
        ahead[1, 64, 0, 64](np.zeros(2, np.int32))


def build_lands_at_wait_kernel(wait_for_it):
    """Each thread of a warpgroup issues S = A B^T (m64n8k16, operands all zero, scale_d = 0) into
    an accumulator holding 7, reads it before the commit and, if `wait_for_it`, after the wait."""
    from common.hardware import target
    mma, wait = sm90.wgmma_ss(8, "bf16"), sm90.wgmma_wait(0, 4)

    @target.kernel
    def issue_then_read(out):
        tid = int32(cuda.threadIdx.x)
        smem = cuda.shared.array(0, uint16)
        for i in range(tid, 8192, 128):
            smem[i] = uint16(0)
        cuda.syncthreads()
        base = sm90.shared_address(smem, 0)
        t0 = int32(((base + uint32(1023)) & uint32(0xFFFFFC00)) - base) >> 1
        desc = sm90.smem_descriptor(sm90.shared_address(smem, t0), 16, 1024)
        acc = cuda.local.array((1, 1, 4), float32)
        tiles.fill(acc, float32(7))
        sm90.wgmma_fence()
        mma(acc, desc, desc, 0)
        out[0, tid] = acc[0, 0, 0]
        sm90.wgmma_commit()
        if wait_for_it:
            wait(acc)
        out[1, tid] = acc[0, 0, 0]

    return issue_then_read


@pytest.mark.sim
def test_wgmma_lands_at_its_wait():
    """The stand-in runs a warpgroup's wgmmas in the wgmma_wait that covers them, the latest a GPU
    may (its accumulators are undefined until then): a read before the wait sees the old value,
    and a kernel that returns without waiting is an error, as for cp.async."""
    dev = cuda.to_device(np.zeros((2, 128), np.float32))
    out = arrays.bits_view(arrays.describe(dev), np.float32)   # launch takes kernel views
    launch(build_lands_at_wait_kernel(True), 1, 128, 16384, 0, out)
    got = dev.copy_to_host()
    assert (got[0] == 7).all() and (got[1] == 0).all()
    with pytest.raises(RuntimeError, match="wgmma issued but never waited for"):
        launch(build_lands_at_wait_kernel(False), 1, 128, 16384, 0, out)


@cuda.jit
def tma_round_trip_kernel(tmaps, row_a, row_b):
    """Box 0 of map 0 (64 rows x 32 words) into shared memory by a tensor load, then out by a
    tensor store of map 1 at row_a; the room restaged (every word + 1) after the wait that allows
    it (wait_group.read: the first store has read its source) and stored again at row_b."""
    tid = int32(cuda.threadIdx.x)
    smem = cuda.shared.array(0, uint16)
    t0 = tma_tiles(smem, tmaps, 2, tid)
    words = cuda.shared.array(0, uint32)
    if tid == 0:
        sm90.mbarrier_arrive_expect_tx(smem, 0, 64 * 128)
        sm90.tma_load_4d(smem, t0, tmaps, 0, 0, 0, 0, 0, smem, 0)
    sm90.mbarrier_wait(smem, 0, 0)
    ptx.fence_proxy_async_shared()
    cuda.syncthreads()
    if tid == 0:
        sm90.tma_store_4d(tmaps, 1, 0, row_a, 0, 0, smem, t0)
        ptx.bulk_commit()
        ptx.bulk_wait_read(0)   # the room may be restaged
    cuda.syncthreads()
    for w in range(tid, 64 * 32, cuda.blockDim.x):
        words[(t0 >> 1) + w] += uint32(1)
    ptx.fence_proxy_async_shared()
    cuda.syncthreads()
    if tid == 0:
        sm90.tma_store_4d(tmaps, 1, 0, row_b, 0, 0, smem, t0)
        ptx.bulk_commit()
        ptx.bulk_wait(0)


def test_tma_store_writes_the_box_and_clips_at_the_end(rng):
    """cp.async.bulk.tensor store (sm90.tma_store_4d, fa3's o_store="tma"): a 64-row box of 32-bit
    words goes back out unswizzled, at any row; rows past the tensor's end are not written (the
    second box starts 28 rows before it); restaging the room after wait_group.read leaves the
    first store's data alone. (The boxes do not overlap: .read orders the source's reads, not
    the two stores' writes.)"""
    src = rng.integers(0, 2 ** 31, (64, 32)).astype(np.uint32)
    dst = np.zeros((100, 32), np.uint32)
    views = [device_view(x.reshape(1, 1, *x.shape), None) for x in (src, dst)]
    tmaps = tensormaps.tensor_maps(((views[0][0], 64, 32), (views[1][0], 64, 32)))
    launch(tma_round_trip_kernel, 1, 128, 1024 + 128 + 64 * 128, 0, tmaps, np.int32(8),
           np.int32(72))
    got = views[1][1].copy_to_host().reshape(100, 32)
    want = np.zeros_like(dst)
    want[8:72] = src
    want[72:100] = src[:28] + 1
    np.testing.assert_array_equal(got, want)
