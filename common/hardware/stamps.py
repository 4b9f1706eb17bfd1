"""Timing stamps for probes, compiled in only when a probe asks for them (a kernel built without
them has no trace of them in its PTX): the SM's cycle counter read inside a kernel and the sums of
the cycles between stamps (`stamper(True)`; experiments/probes/fa3_phases.py reads fa3's forward's,
variants/fa3.py: build(cfg, stamps=True)), and the GPU's global timer, whose stamps a kernel stores
as they are (`timer_stamper(True)`; experiments/probes/decode_stamps.py reads decoding's split
kernel's, variants/decoding.py: build(cfg, stamps=True), written into spare words of the fused
combine's counters).

| name              | PTX                                                                     |
|-------------------|-------------------------------------------------------------------------|
| clock             | mov.u32 %clock, plus %laneid (32 bits, SM cycles; simulator: host ns)   |
| begin(tl)         | (arithmetic) tl's sums zeroed, the clock read                           |
| add(tl, k, t)     | (arithmetic) tl[k] += clock - t, the clock returned                     |
| globaltimer       | mov.u32 %globaltimer_lo (32 bits, ns of the GPU's one timer: comparable |
|                   | across SMs; simulator: host ns)                                         |
| put(words, at, t) | st: words[at] = t, a stamp into an int32 word (its 32 bits as they are) |

    begin, add = stamper(on)     these, or (on=False) stand-ins that read and write nothing

    tl = cuda.local.array(PHASES, uint32)
    t = begin(tl)
    ... phase 0 ...
    t = add(tl, 0, t)            # the cycles since the last stamp, summed into phase 0

    now, put = timer_stamper(on) (globaltimer, put), or (on=False) stand-ins: now() gives 0 and
                                 put stores nothing
    t0 = now()
    ...
    put(words, at, t0)           # the stamp, into an int32 word that the host reads back

Stamps order only with the instructions that have side effects (barrier waits, wgmma issue and
waits, stores, fences): the compiler may move pure arithmetic across them. The sums wrap at 2^32
(uint32), and so does %globaltimer_lo (every 4.3 s): differences are taken mod 2^32.
"""
from numba import int32, uint32

from common.hardware.target import SIMULATOR, device_function

if SIMULATOR:
    import time

    def clock():
        """The host's nanoseconds (low 32 bits): a check of a probe's plumbing only."""
        return uint32(time.perf_counter_ns() & 0xFFFFFFFF)

    def globaltimer():
        """The host's nanoseconds (low 32 bits), one clock for every simulated thread: a check
        of a probe's plumbing only."""
        return uint32(time.perf_counter_ns() & 0xFFFFFFFF)

else:
    from numba import types
    from numba.cuda.extending import intrinsic

    from common.hardware._inline_asm import _asm, _i32

    @intrinsic
    def clock(typingctx):
        sig = types.uint32()

        def codegen(context, builder, sig, args):
            # %clock plus the lane's index, which the differences cancel: a value that differs
            # across the warp keeps ptxas from reading the clock on the uniform datapath (S2UR),
            # whose reads it moved across barriers and stores
            return _asm(builder, _i32, [], "{ .reg .u32 t; mov.u32 $0, %clock; "
                        "mov.u32 t, %laneid; add.u32 $0, $0, t; }", "=r,~{memory}",
                        side_effect=True)

        return sig, codegen

    @intrinsic
    def globaltimer(typingctx):
        sig = types.uint32()

        def codegen(context, builder, sig, args):
            # the low 32 bits of the GPU's nanosecond timer, the same on every SM (as
            # decode_stamps.py's stamps read it since docs/results/decode_epilogue_h100.txt)
            return _asm(builder, _i32, [], "mov.u32 $0, %globaltimer_lo;", "=r",
                        side_effect=True)

        return sig, codegen


@device_function
def begin(tl):
    """Zero the sums tl (a uint32 local array) and read the clock: the first stamp."""
    for k in range(tl.shape[0]):
        tl[k] = uint32(0)
    return clock()


@device_function
def add(tl, k, t0):
    """tl[k] += now - t0 (uint32, wraps); returns now."""
    t1 = clock()
    tl[k] += uint32(t1 - t0)
    return t1


@device_function
def _begin_off(tl):
    return uint32(0)


@device_function
def _add_off(tl, k, t0):
    return t0


def stamper(on):
    """(begin, add): the stamps, or for on=False their stand-ins, which compile to nothing."""
    return (begin, add) if on else (_begin_off, _add_off)


@device_function
def put(words, at, t):
    """words[at] = t: a stamp (uint32) into an int32 word, its 32 bits as they are."""
    words[at] = int32(t)


@device_function
def _now_off():
    return uint32(0)


@device_function
def _put_off(words, at, t):
    return


def timer_stamper(on):
    """(now, put): the global timer and a stamp's store, or for on=False their stand-ins (now()
    gives 0, put stores nothing), which compile to nothing."""
    return (globaltimer, put) if on else (_now_off, _put_off)
