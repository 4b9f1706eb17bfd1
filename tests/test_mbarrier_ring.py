"""common/tile/mbarrier_ring.py, the TMA/mbarrier stage ring fa3's forward and backward share: the
(stage, parity) of each fill, and rows streamed through a ring of 1 to 3 stages by a producer warp
(TMA with `arm`, cp.async with `arrive_when_landed`, or its own stores with `arrive_full`) to two
consumer warps that wait for each fill and release it, on the GPU or in the simulator (where a
wait that cannot complete raises: a wrong parity or a missing arrival fails the test instead of
hanging it)."""
from functools import lru_cache

import numpy as np
import pytest
from numba import cuda, int32, uint16, uint32

from common.hardware import ptx, sm90
from common.hardware.target import device_function, kernel
from common.host import arrays, tensormaps
from common.host.launching import launch
from common.tile import mbarrier_ring, tiles

ROWS, COLS = 8, 64          # a fill: 8 rows of 64 uint16, one 128-byte-swizzled TMA box
TILE = ROWS * COLS          # its elements
STEPS = 7
CONSUMERS = 2               # consumer warps (warps 0, 1); the producer is warp 2


@lru_cache(maxsize=None)
def slot_kernel(stages):
    slot = mbarrier_ring.ring(stages, 0, 4 * stages, 1, 1).slot

    @kernel
    def slots(out):
        it = int32(cuda.threadIdx.x)
        out[it, 0], out[it, 1] = slot(it)

    return slots


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_slot_and_parity_of_each_fill(stages):
    """Fill it goes to stage it mod stages, in the ring's (it // stages)-th turn: parity its
    lowest bit (what a consumer waits on, the producer's wait on empty the other one)."""
    n = 12
    out = cuda.to_device(np.full((n, 2), -1, np.int64))
    slot_kernel(stages)[1, n](out)
    it = np.arange(n)
    want = np.stack([it % stages, (it // stages) & 1], 1)
    np.testing.assert_array_equal(out.copy_to_host(), want)


@device_function
def swizzled(r, c):
    """Element (r, c) of a 128-byte-swizzled tile of 64-column rows (1024-byte aligned): 16-byte
    chunk c // 8 of row r at chunk (c // 8) ^ (r % 8), as TMA lands it."""
    return r * COLS + (((c >> 3) ^ (r & 7)) << 3) + (c & 7)


@lru_cache(maxsize=None)
def stream_kernel(stages, producer):
    """Rows 8 it .. 8 it + 7 of src through the ring's fill it, read back into out by the
    consumer warps. producer: "tma" (lane 0 arms the full mbarrier with the box's bytes and
    issues the copy onto it: full count 1), "cp_async" (each lane's 16-byte copies, then its
    arrival once they land: count 32; the consumers' waits fence the generic-proxy writes) or
    "stores" (each lane's own stores, then its arrival: count 32)."""
    ring = mbarrier_ring.ring(stages, 0, 4 * stages, 1 if producer == "tma" else 32, CONSUMERS,
                              producer == "cp_async")
    slot, init, acquire, arm, full = ring.slot, ring.init, ring.acquire, ring.arm, ring.full
    landed, arrive_full, wait_full, release = (ring.arrive_when_landed, ring.arrive_full,
                                               ring.wait_full, ring.release)
    TMA, CP_ASYNC = producer == "tma", producer == "cp_async"

    @kernel
    def stream(tmaps, src, out, n):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        smem = cuda.shared.array(0, uint16)
        base = sm90.shared_address(smem, 0)
        t0 = int32(((base + uint32(128 + 1023)) & uint32(0xFFFFFC00)) - base) >> 1
        rows = src[0, 0]
        if tid == 0:
            init(smem)
            sm90.fence_mbarrier_init()
        cuda.syncthreads()
        if warp == CONSUMERS:                     # the producer warp
            if TMA:   # one thread produces (FA3's): the other lanes, with nothing to do, leave.
                # (Had they waited on the empty mbarriers too, a lane left behind could find
                # the stage's barrier two phases on, its parity as before, and wait forever: the
                # simulator's threads do lag under load; 3% of runs hung so.)
                if lane != 0:
                    return
                sm90.tensormap_acquire(tmaps, 0)
            for it in range(n):
                stage, parity = slot(it)
                acquire(smem, it, stage, parity)  # the consumers released its fill before
                dst = t0 + stage * TILE
                if TMA:
                    arm(smem, stage, TILE * 2)
                    sm90.tma_load_4d(smem, dst, tmaps, 0, 0, it * ROWS, 0, 0, smem, full(stage))
                elif CP_ASYNC:
                    tiles.load_tile_async(smem[dst:dst + TILE], rows, it * ROWS, n * ROWS, 0,
                                          ROWS, COLS, COLS, True, lane, 32, False)
                    landed(smem, stage)
                else:
                    for e in range(lane, TILE, 32):
                        r, c = e // COLS, e % COLS
                        smem[dst + swizzled(r, c)] = rows[it * ROWS + r, c]
                    arrive_full(smem, stage)
            return
        for it in range(n):                       # a consumer warp
            stage, parity = slot(it)
            wait_full(smem, stage, parity)
            for e in range(tid, TILE, 32 * CONSUMERS):
                r, c = e // COLS, e % COLS
                out[it * ROWS + r, c] = smem[t0 + stage * TILE + swizzled(r, c)]
            ptx.syncwarp()                        # every lane has read the fill
            release(smem, stage, lane)

    return stream


@pytest.mark.parametrize("stages, producer", [(1, "stores"), (2, "tma"), (3, "cp_async"),
                                              (2, "stores"), (3, "tma")])
def test_ring_streams_every_fill(rng, stages, producer):
    # In the simulator a broken ring fails after sm90.WAIT_TIMEOUT_S (60 s) instead of waiting.
    # Not less: under CI's load (two workers simulating on two cores) a correct wait once took
    # over 10 s, the limit this test used to set (2026-12-07).
    src = rng.integers(0, 1 << 16, (1, 1, STEPS * ROWS, COLS), dtype=np.uint16)
    src_dev = cuda.to_device(src)
    out_dev = cuda.to_device(np.zeros((STEPS * ROWS, COLS), np.uint16))
    src_view = arrays.bits_view(arrays.describe(src_dev, "src"), np.uint16)
    out_view = arrays.bits_view(arrays.describe(out_dev, "out"), np.uint16)
    tmaps = tensormaps.tensor_maps(((src_view, ROWS, COLS),))
    smem = 128 + 1024 + stages * TILE * 2
    launch(stream_kernel(stages, producer), 1, 32 * (CONSUMERS + 1), smem, 0, tmaps, src_view,
           out_view, np.int32(STEPS))
    np.testing.assert_array_equal(out_dev.copy_to_host(), src[0, 0])


def test_barrier_offsets_and_counts():
    """The ring's fields as a kernel builder reads them: stage s's mbarriers 4 s elements (8
    bytes) after the first; rings made once per set of constants."""
    r = mbarrier_ring.ring(3, 8, 20, 1, 8)
    assert r.stages == 3 and mbarrier_ring.BARRIER_ELEMS == 4
    assert mbarrier_ring.ring(3, 8, 20, 1, 8) is r
    assert mbarrier_ring.ring(3, 8, 20, 1, 8, True) is not r
