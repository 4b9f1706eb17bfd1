"""common/hardware/_sim_block.py, the simulator's event-driven thread block: barriers release when the last
live thread arrives, a thread that returned no longer counts, and an exception in one thread is
raised from the launch (naming the thread) without leaving the others blocked at the barrier."""
import numpy as np
import pytest
from numba import cuda, float32, uint16

from common.hardware.target import SIMULATOR  # importing common.hardware.target installs _sim_block
from tests.conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the simulator's block manager")


@cuda.jit
def rotate_through_shared(out, rounds):
    """Each round every thread writes its value, and after a barrier reads its neighbour's."""
    buf = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    x = np.float32(t)
    for _ in range(rounds):
        buf[t] = x
        cuda.syncthreads()
        x = buf[(t + 1) % 64]
        cuda.syncthreads()
    out[t] = x


def test_barriers_order_shared_memory():
    out = np.zeros(64, np.float32)
    rotate_through_shared[2, 64](out, 5)
    np.testing.assert_array_equal(out, (np.arange(64) + 5) % 64)


@cuda.jit
def half_leave_early(out):
    """Threads 32-63 return; the others meet at two more barriers (counted without them)."""
    t = cuda.threadIdx.x
    if t >= 32:
        return
    cuda.syncthreads()
    out[t] = cuda.syncthreads_count(1)


def test_returned_threads_no_longer_count():
    out = np.zeros(32, np.int32)
    half_leave_early[1, 64](out)
    assert (out == 32).all()


@cuda.jit
def one_thread_raises(out):
    t = cuda.threadIdx.x
    if t == 5:
        out[100] = 1.0      # out of bounds: the simulator raises IndexError
    cuda.syncthreads()
    out[t] = 1.0


def test_an_exception_is_raised_from_the_launch_naming_its_thread():
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\]"):
        one_thread_raises[1, 32](np.zeros(32, np.float32))
    out = np.zeros(64, np.float32)        # and the simulator runs the next launch as before
    rotate_through_shared[1, 64](out, 1)
    np.testing.assert_array_equal(out, (np.arange(64) + 1) % 64)


@cuda.jit
def read_dynamic_shared(out):
    """Each thread reads a word of dynamic shared memory that nothing wrote."""
    f32 = cuda.shared.array(0, float32)
    u16 = cuda.shared.array(0, uint16)
    t = cuda.threadIdx.x
    out[t, 0] = f32[t]
    out[t, 1] = u16[t]


def test_dynamic_shared_memory_starts_as_nan():
    """A word no copy or store wrote reads as NaN (0xFF bytes), not as the simulator's zeros: a
    kernel that relies on shared memory being clear fails in the simulator as it would on a GPU."""
    assert SIMULATOR
    out = np.zeros((32, 2), np.float32)
    read_dynamic_shared[1, 32, 0, 256](out)
    assert np.isnan(out[:, 0]).all() and (out[:, 1] == 0xFFFF).all()


def test_launch_takes_only_what_the_gpu_path_passes():
    """launching.launch packs KernelViews and np.int32 / np.uint32 / np.float32 scalars for
    cuLaunchKernel; the simulator refuses any other argument too, so a call the GPU path cannot
    make fails in CI (a np.uint32 fill value did, before the GPU path took uint32: it passed the
    simulator and raised KeyError on the GPU)."""
    from common.host import arrays, launching
    out = np.zeros(64, np.float32)
    view = arrays.bits_view(arrays.describe(cuda.to_device(out)), np.float32)
    with pytest.raises(TypeError, match="np.uint32 / np.float32 scalars, got int64"):
        launching.launch(rotate_through_shared, 1, 64, 0, 0, view, np.int64(1))
    with pytest.raises(TypeError, match="got int"):
        launching.launch(rotate_through_shared, 1, 64, 0, 0, view, 1)
    launching.launch(rotate_through_shared, 1, 64, 0, 0, view, np.int32(1))
