"""common/tile/pingpong.py, the consumer warpgroups' turns at the tensor cores (fa3's ping-pong):
two warpgroups take their turns in alternation on named barriers, tile after tile, with no turn
left pending at the end (the last warpgroup's last turn is not passed on), on the GPU or in the
simulator (where a named barrier that cannot complete raises)."""
from functools import lru_cache

import numpy as np
import pytest
from numba import cuda, int32, uint16

from common.hardware import sm80, sm90
from common.hardware.target import kernel
from common.tile import pingpong

GROUPS = 2


@lru_cache(maxsize=None)
def turn_kernel(on):
    begin, wait, pass_on, hand_on = pingpong.turns(GROUPS, 4, on)

    @kernel
    def take_turns(log, counter, tiles, turns):
        """Each warpgroup's thread 0 logs its warpgroup at each of its turns: `turns` a tile,
        the last one of a tile handed on (hand_on), the tiles one after another."""
        tid = int32(cuda.threadIdx.x)
        wg = tid >> 7
        smem = cuda.shared.array(0, uint16)
        if tid == 0:   # a block with an mbarrier: the simulator's collectives meet their threads
            sm90.mbarrier_init(smem, 0, 1)
            sm90.fence_mbarrier_init()
        cuda.syncthreads()
        begin(wg, True)
        for t in range(tiles):
            for u in range(turns):
                wait(wg)
                if tid & 127 == 0:
                    log[cuda.atomic.add(counter, 0, 1)] = wg
                if u < turns - 1:
                    pass_on(wg)
            hand_on(wg, t == tiles - 1)

    return take_turns


@pytest.mark.parametrize("tiles, turns", [(1, 1), (3, 2)])
def test_warpgroups_take_turns_in_alternation(monkeypatch, tiles, turns):
    monkeypatch.setattr(sm80, "NAMED_BARRIER_TIMEOUT_S", 10.0, raising=False)   # fail, not wait
    n = GROUPS * tiles * turns
    log = cuda.to_device(np.full(n, -1, np.int32))
    counter = cuda.to_device(np.zeros(1, np.int32))
    turn_kernel(True)[1, 128 * GROUPS, 0, 64](log, counter, np.int32(tiles), np.int32(turns))
    np.testing.assert_array_equal(log.copy_to_host(), np.arange(n) % GROUPS)


def test_turns_off_are_no_barriers():
    """on=False (one warpgroup, or ping-pong off): every call a no-op, nothing waits."""
    log = cuda.to_device(np.full(4, -1, np.int32))
    counter = cuda.to_device(np.zeros(1, np.int32))
    turn_kernel(False)[1, 128 * GROUPS, 0, 64](log, counter, np.int32(2), np.int32(1))
    assert sorted(log.copy_to_host()) == [0, 0, 1, 1]
