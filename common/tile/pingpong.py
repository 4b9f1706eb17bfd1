"""Ping-pong (FA3 section 3.1, inter-warpgroup overlap): the consumer warpgroups of a block take
turns at the tensor cores, so that one warpgroup's softmax runs while the tensor cores do the
next one's GEMMs, instead of all of them computing exponentials at once with the tensor cores
idle. The turn goes round on named barriers: barrier first + w (of two warpgroups' threads)
completes when warpgroup w has asked for its turn (bar.sync) and warpgroup w - 1 has handed it on
(bar.arrive), after issuing its GEMMs.

    t = turns(groups, first, on)        (one per configuration; on=False: every call a no-op)
    t.begin(wg, first_turn)             warpgroup 0 gives itself the first turn (when first_turn)
    t.wait(wg)                          wait for this warpgroup's turn
    t.pass_on(wg)                       its GEMMs are issued: the next warpgroup's turn
    t.hand_on(wg, final)                pass_on, but for the last warpgroup's at the block's last
                                        tile (nobody waits for that one)

A kernel keeps the turn going round without a break from tile to tile (the last warpgroup's last
turn of a tile is warpgroup 0's first of the next): were warpgroup 0 to give itself a turn a
tile, it could hand on two turns before the next warpgroup took one, and the turns would drift a
phase apart. Device functions closed over the constants, inlined (a kernel builder unpacks the
ones it calls into names of its own).
"""
from collections import namedtuple
from functools import lru_cache

from common.hardware import ptx
from common.hardware.target import device_function

Turns = namedtuple("Turns", "begin wait pass_on hand_on")


@lru_cache(maxsize=None)
def turns(groups, first, on, group_threads=128):
    """The turns of `groups` warpgroups (of group_threads threads) on named barriers first ..
    first + groups - 1; `on` False (ping-pong off, or one warpgroup): no barrier at all."""
    NWG, TURN, ON = groups, first, on
    TURN_THREADS = 2 * group_threads

    @device_function
    def begin(wg, first_turn):
        """Warpgroup 0 gives itself the first turn of the block (when first_turn)."""
        if ON and wg == 0 and first_turn:
            ptx.bar_arrive(TURN, TURN_THREADS)

    @device_function
    def wait(wg):
        """Wait until the warpgroup before this one has issued its GEMMs."""
        if ON:
            ptx.bar_sync(TURN + wg, TURN_THREADS)

    @device_function
    def pass_on(wg):
        """This warpgroup's GEMMs are issued; the next warpgroup may issue its own (and the
        tensor cores run them while this one computes its softmax)."""
        if ON:
            ptx.bar_arrive(TURN + (wg + 1) % NWG, TURN_THREADS)

    @device_function
    def hand_on(wg, final):
        """The end of a tile's turns: passed on, but for the last warpgroup's at the block's last
        tile (`final`)."""
        if wg != NWG - 1 or not final:
            pass_on(wg)

    return Turns(begin, wait, pass_on, hand_on)
