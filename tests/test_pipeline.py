"""common/tile/pipeline.py, the cp.async stage ring: its slot arithmetic, and a ring of two buffers
streaming rows through shared memory (each step's copy issued a step ahead) on the GPU or in the
simulator, where a copy lands only at the wait that covers it."""
import numpy as np
import pytest
from numba import cuda, int32, uint16

from common.hardware import ptx
from common.hardware.target import kernel
from common.tile import pipeline

STEPS, ROW = 7, 8   # rows of 8 uint16 (one 16-byte cp.async each)
RING_BYTES = 2 * ROW * 2   # the two slots, in dynamic shared memory: 16-byte aligned, as cp.async
                          # needs its destinations (a static uint16 array is aligned to 2 bytes
                          # only; and `cuda.shared.array(2 * ROW, uint16)`, a shape Numba does not
                          # fold to a constant, did not compile on the GPU)


@kernel
def slots(out):
    j = cuda.threadIdx.x
    out[j, 0] = pipeline.slot(j, 2)
    out[j, 1] = pipeline.slot(j, 4)
    out[j, 2] = pipeline.other(pipeline.slot(j, 2))
    out[j, 3] = pipeline.slot_start(100, j, 4, 10)


def test_slot_of_step():
    out = cuda.to_device(np.zeros((9, 4), np.int64))
    slots[1, 9](out)
    j = np.arange(9)
    assert (out.copy_to_host() == np.stack([j % 2, j % 4, 1 - j % 2, 100 + 10 * (j % 4)], 1)).all()


@kernel
def stream_rows(src, out, n_steps):
    """Row j of src copied into slot j mod 2 one step ahead, read back from it at step j."""
    smem = cuda.shared.array(0, uint16)
    tid = int32(cuda.threadIdx.x)
    if tid == 0:
        ptx.cp_async_16(smem, 0, src, 0, 0, 16)
    pipeline.commit()
    for j in range(n_steps):
        buf = pipeline.slot_start(0, j, 2, ROW)
        pipeline.wait_and_release(0)   # row j landed; every thread is done with row j-1's slot
        if tid == 0 and j + 1 < n_steps:
            ptx.cp_async_16(smem, pipeline.slot_start(0, j + 1, 2, ROW), src, j + 1, 0, 16)
        pipeline.commit()
        for c in range(ROW):           # step j computes on its row while row j+1 is copied
            if c % cuda.blockDim.x == tid:
                out[j, c] = smem[buf + c]
        pipeline.release()             # every thread is done with row j: its slot may be refilled
    pipeline.wait(0)


@pytest.mark.parametrize("threads", [1, 4])
def test_ring_of_two_streams_every_row(rng, threads):
    src = rng.integers(0, 1 << 16, (STEPS, ROW), dtype=np.uint16)
    out = cuda.to_device(np.zeros_like(src))
    stream_rows[1, threads, 0, RING_BYTES](cuda.to_device(src), out, np.int32(STEPS))
    assert (out.copy_to_host() == src).all()
