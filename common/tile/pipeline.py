"""The stage ring of a cp.async pipeline (sm_80-style): a tile's copies for step j+1 land in one
buffer while step j computes on another, every thread of the block both producing (issuing copies)
and consuming (reading the tiles). fa3's ring (TMA copies into stages guarded by full/empty
mbarriers, a producer warp) is common/tile/mbarrier_ring.py, over common/hardware/sm90.py's
instructions; it takes the step arithmetic of such a ring from `phase_slot`.

    slot(j, stages), slot_start(start, j, stages, size)    which buffer step j uses, where it starts
    commit()                   produce: the copies issued since the last commit are one group
    wait(pending)              consume: this thread's groups but the newest `pending` have landed
    release()                  a block barrier: every warp is done reading what it read before it,
                               so that buffer may be refilled
    wait_and_release(pending)  wait, then the barrier: every thread's copies of those groups are
                               visible to all, and the buffer read before it released
    other(slot)                the other slot of a ring of two

    phase_slot(j, stages)      an mbarrier ring's (stage, parity) of step j (fa3's TMA rings)

A ring of `stages` buffers (a power of two): step j uses slot j mod stages. A kernel whose copies
for step j+1 are issued at the top of step j (after its wait_and_release) keeps one group in flight
while it computes. Every helper is inlined (common.hardware.target.device_function): a kernel that calls them
compiles to the PTX of the arithmetic written out (`pending` must be a literal int: it is the
immediate of cp.async.wait_group).
"""
from numba import cuda

from common.hardware import ptx
from common.hardware.target import device_function


@device_function
def slot(step, stages):
    """The buffer of step `step` (counted from the ring's first step) in a ring of `stages`, a
    power of two: step mod stages."""
    return step & (stages - 1)


@device_function
def other(current):
    """The other buffer of a ring of two: the one the next step fills while this one is read."""
    return 1 - current


@device_function
def slot_start(start, step, stages, size):
    """Where step `step`'s buffer begins: buffers of `size` elements one after another from
    `start`."""
    return start + slot(step, stages) * size


@device_function
def commit():
    """Produce: close the group of copies this thread has issued since its last commit (a stage's
    tiles; an empty group when it issued none, so that every thread counts the same groups)."""
    ptx.cp_async_commit()


@device_function
def wait(pending):
    """Consume: wait until at most `pending` (a literal int) of this thread's committed groups are
    still in flight, i.e. all but the newest `pending` have landed. Other threads' copies are not
    covered: reading them needs wait_and_release."""
    ptx.cp_async_wait(pending)


@device_function
def release():
    """The block barrier after the last read of a buffer: every warp is done with it, so copies
    issued after this call may refill it."""
    cuda.syncthreads()


@device_function
def wait_and_release(pending):
    """wait(pending) in every thread, then the block barrier: the groups' tiles are in shared
    memory for every warp to read, and no warp still reads the buffer that the copies issued after
    this call refill."""
    ptx.cp_async_wait(pending)
    cuda.syncthreads()


@device_function
def phase_slot(step, stages):
    """(stage, parity) of step `step` through a ring of `stages` buffers guarded by mbarriers
    (stages: 1 to 4, any): its buffer, step mod stages, and the parity of that buffer's fill (and
    release) phase, the number of times the ring has gone round mod 2. A consumer waits on the
    buffer's full barrier with that parity; a producer refilling it waits on its empty barrier
    with the other parity (the release of the fill before)."""
    return step % stages, (step // stages) & 1
