"""common/hardware/stamps.py, a probe's timing stamps: with them on, the sums of the cycles between
stamps add up to the clock's advance from the first stamp to the last (mod 2^32); off, they read
and write nothing (experiments/probes/fa3_phases.py reads fa3's)."""
from functools import lru_cache

import numpy as np
import pytest
from numba import cuda, uint32

from common.hardware.stamps import stamper
from common.hardware.target import kernel

PHASES = 3


@lru_cache(maxsize=None)
def stamp_kernel(on):
    begin, add = stamper(on)

    @kernel
    def stamped(out, ends, n):
        tl = cuda.local.array(PHASES, uint32)
        for k in range(PHASES):
            tl[k] = uint32(7)
        t = begin(tl)
        first = t
        x = uint32(1)
        for k in range(n):
            x = x * uint32(3) + uint32(k)      # some work between stamps
            t = add(tl, k % PHASES, t)
        for k in range(PHASES):
            out[k] = tl[k]
        ends[0], ends[1], ends[2] = first, t, x

    return stamped


@pytest.mark.parametrize("on", [True, False])
def test_stamps_sum_the_clock(on):
    out = cuda.to_device(np.zeros(PHASES, np.uint32))
    ends = cuda.to_device(np.zeros(3, np.uint32))
    stamp_kernel(on)[1, 1](out, ends, np.int32(10))
    tl, (first, last, _) = out.copy_to_host(), ends.copy_to_host()
    if on:
        assert int(tl.sum(dtype=np.uint64)) % 2 ** 32 == (int(last) - int(first)) % 2 ** 32
    else:
        assert (tl == 7).all() and first == last == 0
