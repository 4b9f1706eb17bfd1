"""The stage ring of a TMA pipeline (sm_90, warp-specialised): a producer copies tiles into
`stages` buffers in turn, consumers compute on them, and each buffer is guarded by two mbarriers
instead of a block barrier. Its "full" mbarrier completes when the stage's tile has landed (the
producer's arrivals, and with TMA the copies' bytes: `arm`); its "empty" mbarrier completes when
every consumer warp has released the stage (`release`), after which the producer may refill it
(`acquire`). flash_attn/cute's PipelineTmaAsync is this ring; common/tile/pipeline.py has the
cp.async ring, whose every thread both copies and computes.

    r = ring(stages, full, empty, full_count, empty_count, fence=False)   (one per configuration)

    r.slot(it)                       (stage, parity) of the ring's it-th fill (pipeline.phase_slot)
    r.full(stage)                    the full mbarrier's offset (a TMA copy's completion operand)
    r.init(smem)                     every stage's full then empty mbarrier, with their counts
    r.init_full(smem, stage), r.init_empty(smem, stage)   one of them (rings whose mbarriers are
                                     made interleaved with another ring's)
  producer
    r.acquire(smem, it, stage, parity)   before the it-th fill: wait until the consumers have
                                     released the fill `stages` before it (none for the first ones)
    r.arm(smem, stage, nbytes)       an arrival on full that expects nbytes of copies (TMA)
    r.arrive_when_landed(smem, stage)    an arrival on full once this thread's cp.async copies
                                     so far have landed
    r.arrive_full(smem, stage)       an arrival on full (what this thread stored itself has landed)
  consumer
    r.wait_full(smem, stage, parity) wait for the fill; with `fence`, then a proxy fence (the
                                     fills are generic-proxy writes, cp.async or stores, that
                                     wgmma reads through the async proxy)
    r.release(smem, stage, lane)     this warp is done with the stage: one arrival, from lane 0
    r.arrive_empty(smem, stage)      an arrival on empty from this thread

Offsets (`full`, `empty`) are in elements of the kernel's uint16 shared array, an mbarrier 8
bytes, BARRIER_ELEMS elements, after the one before: stage s's full mbarrier at full + 4 s, its
empty one at empty + 4 s. The counts: `full_count` arrivals complete a fill (one `arm` for TMA,
one arrival a copying thread for cp.async), `empty_count` a release (one a consumer warp). The
parity of a fill's wait is that of the ring's turns so far (pipeline.phase_slot); the producer's
wait on empty before refilling a stage waits on the other parity, the release of the fill before.
Every function is a device function closed over the ring's constants, inlined into the kernel
(Numba inlines device functions it reaches by name, not as a tuple's field: a kernel builder
unpacks the ones it calls into names of its own).
"""
from collections import namedtuple
from functools import lru_cache

from common.hardware import ptx, sm90
from common.hardware.target import device_function
from common.tile import pipeline

BARRIER_ELEMS = 4   # an mbarrier (8 bytes) in elements of a uint16 shared array

Ring = namedtuple("Ring", "stages slot full init init_full init_empty acquire arm "
                          "arrive_when_landed arrive_full wait_full release arrive_empty")


@lru_cache(maxsize=None)
def ring(stages, full, empty, full_count, empty_count, fence=False):
    """The device functions of a ring of `stages` buffers whose full mbarriers start at element
    `full` and empty ones at `empty` of the shared array (see the module's docstring)."""
    STAGES, FULL, EMPTY, FULL_COUNT, EMPTY_COUNT, FENCE = (stages, full, empty, full_count,
                                                           empty_count, fence)

    @device_function
    def slot(it):
        """(stage, parity) of the it-th fill through the ring: its buffer and the parity of that
        buffer's fill (and release) phase."""
        return pipeline.phase_slot(it, STAGES)

    @device_function
    def full_barrier(stage):
        return FULL + BARRIER_ELEMS * stage

    @device_function
    def init_full(smem, stage):
        sm90.mbarrier_init(smem, FULL + BARRIER_ELEMS * stage, FULL_COUNT)

    @device_function
    def init_empty(smem, stage):
        sm90.mbarrier_init(smem, EMPTY + BARRIER_ELEMS * stage, EMPTY_COUNT)

    @device_function
    def init(smem):
        """Every stage's mbarriers (one thread; then sm90.fence_mbarrier_init and a block
        barrier before any thread uses them)."""
        for s in range(STAGES):
            init_full(smem, s)
            init_empty(smem, s)

    @device_function
    def acquire(smem, it, stage, parity):
        """The producer, before the it-th fill (into `stage`, of `parity`: slot(it)): the
        consumers have released what the stage held `stages` fills before."""
        if it >= STAGES:
            sm90.mbarrier_wait(smem, EMPTY + BARRIER_ELEMS * stage, parity ^ 1)

    @device_function
    def arm(smem, stage, nbytes):
        """The producer's arrival on the stage's full mbarrier, expecting nbytes of TMA copies
        (issued after it onto full(stage)): the fill completes when they have landed."""
        sm90.mbarrier_arrive_expect_tx(smem, FULL + BARRIER_ELEMS * stage, nbytes)

    @device_function
    def arrive_when_landed(smem, stage):
        """A copying thread's arrival on the stage's full mbarrier once its cp.async copies issued
        so far have landed (cp.async.mbarrier.arrive)."""
        sm90.cp_async_mbarrier_arrive(smem, FULL + BARRIER_ELEMS * stage)

    @device_function
    def arrive_full(smem, stage):
        """An arrival on the stage's full mbarrier (what this thread wrote itself is in place)."""
        sm90.mbarrier_arrive(smem, FULL + BARRIER_ELEMS * stage)

    @device_function
    def wait_full(smem, stage, parity):
        """A consumer waits for the fill of `parity` of `stage`. With `fence` (fills written in
        the generic proxy, read by wgmma in the async proxy) a proxy fence follows: TMA lands in
        the async proxy already."""
        sm90.mbarrier_wait(smem, FULL + BARRIER_ELEMS * stage, parity)
        if FENCE:
            ptx.fence_proxy_async_shared()

    @device_function
    def release(smem, stage, lane):
        """This warp is done reading the stage: one arrival (lane 0's) on its empty mbarrier."""
        if lane == 0:
            sm90.mbarrier_arrive(smem, EMPTY + BARRIER_ELEMS * stage)

    @device_function
    def arrive_empty(smem, stage):
        """An arrival on the stage's empty mbarrier from this thread."""
        sm90.mbarrier_arrive(smem, EMPTY + BARRIER_ELEMS * stage)

    return Ring(STAGES, slot, full_barrier, init, init_full, init_empty, acquire, arm,
                arrive_when_landed, arrive_full, wait_full, release, arrive_empty)
