"""The simulator's machinery under the PTX stand-ins (common/hardware/sm80.py, common/hardware/sm90.py): what they
share that is no instruction's own, used under NUMBA_ENABLE_CUDASIM=1 only.

- per-block state (`block_state`, kept on the simulator's block manager) and group collectives:
  a warp-collective stand-in (mma, ldmatrix, shuffles; sm90's wgmma wait) must see the other
  lanes' registers, so each thread publishes its operand and waits at a barrier
  (`group_collective`, `warp_collective`). The barrier is the block's (every thread of the block
  must then reach the same sequence of collectives; the kernels are written that way) until
  `independent_groups()` (called by sm90's mbarrier_init) makes each group meet alone, as on the
  GPU, which warp-specialised kernels need;
- per-thread asynchronous groups (`async_groups`, `commit_group`: cp.async's copies, wgmma's MMAs,
  done at the wait that covers them) and the checks every simulated thread runs when its kernel
  returns (`EXIT_CHECKS`, `check_at_exit`, called by common/hardware/target.py's `kernel`): each
  instruction module registers its own;
- `unwrap`: the NumPy array behind a simulator array.

Kept apart from the instructions so that sm80.py and sm90.py read as instruction beside stand-in,
and apart from common/hardware/_sim_block.py (the thread block itself, whose Barrier the groups wait on).
"""
import itertools
import threading

import numpy as np

from common.hardware import _sim_block


def unwrap(ary):
    """The NumPy array behind a simulator array (shared and local arrays already are NumPy)."""
    if isinstance(ary, np.ndarray):
        return ary
    ary = vars(ary).get("_item", ary)  # FakeWithinKernelCUDAArray wraps a FakeCUDAArray
    return vars(ary)["_ary"]


# --------------------------------------------------------------------------- group collectives

_setup_lock = threading.Lock()


class _Group:
    """Rendezvous state of one group of threads that meet in a collective (a warp, a warpgroup, the
    threads of a named barrier): a barrier of the group's size and slots double-buffered by call
    parity."""
    __slots__ = ("barrier", "slots", "arrivals", "results", "size")

    def __init__(self, size):
        self.size = size
        self.barrier = _sim_block.Barrier(size)
        self.slots = [[None] * size, [None] * size]
        self.arrivals = [itertools.count(), itertools.count()]
        self.results = [None, None]


def block_state(t=None):
    """Per-thread-block state of the stand-ins (kept on the simulator's block manager), created on
    first use: `groups` (key -> _Group) and whatever other stand-ins keep there."""
    t = t or threading.current_thread()
    if not hasattr(t, "_manager"):
        raise RuntimeError("PTX stand-ins run only inside a kernel launched in the CUDA simulator")
    state = getattr(t._manager, "_ptx_state", None)
    if state is None:
        with _setup_lock:
            state = getattr(t._manager, "_ptx_state", None)
            if state is None:
                state = t._manager._ptx_state = {"groups": {}}
    return state


def _group(key, size):
    groups = block_state()["groups"]
    group = groups.get(key)
    if group is None:
        with _setup_lock:
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(size)
    if group.size != size:
        raise RuntimeError(f"collective {key!r} met with {size} threads, earlier with {group.size}")
    return group


def independent_groups():
    """From here on this thread block's collectives meet only their own group (a warp, a warpgroup,
    a named barrier's threads), as on the GPU. Warp-specialised kernels need that: their producer
    never reaches the consumers' collectives. (The mbarrier stand-in calls it: a block that
    initialises an mbarrier may specialise its warps.) Other blocks meet at the block barrier,
    which orders at least as much when every thread reaches the same collectives and runs the
    simulator about 1.8x faster (fa2's forward). Call it before the block's first collective
    (fa3 initialises its mbarriers before anything else)."""
    block_state()["independent"] = True


def group_collective(key, size, index, value, compute=None, always_own_barrier=False):
    """Publish this thread's `value` as member `index` of the group `key` of `size` threads; once
    all have, `compute(values)` runs once (in the last to arrive) and every member gets the result
    after a barrier: the group's own (only its threads wait, as on the GPU) after
    `independent_groups()` or with `always_own_barrier`, else the block's.

    One barrier per call: slots, arrival counters and results are double-buffered by call parity
    (counted per thread and group). Call n's buffers are reused only by call n+2, which no member
    reaches before every member has left call n+1's barrier, i.e. has finished with call n. (`next`
    on itertools.count is atomic under the GIL, so exactly one member sees the last arrival.)"""
    t = threading.current_thread()
    group = _group(key, size)
    calls = t.__dict__.setdefault("_ptx_calls", {})
    n = calls.get(key, 0)
    calls[key] = n + 1
    p = n & 1
    group.slots[p][index] = value
    if next(group.arrivals[p]) == size - 1:
        group.arrivals[1 - p] = itertools.count()
        group.results[p] = compute(group.slots[p]) if compute else list(group.slots[p])
    if always_own_barrier or block_state(t).get("independent", False):
        group.barrier.wait()
    else:
        t.syncthreads()
    return group.results[p]


def warp_collective(value, compute=None):
    """group_collective over the 32 lanes of this thread's warp: returns (result, lane)."""
    t = threading.current_thread()
    if not hasattr(t, "_manager"):
        raise RuntimeError("PTX stand-ins run only inside a kernel launched in the CUDA simulator")
    bx, by, bz = t._manager._block_dim
    if (bx * by * bz) % 32:
        raise RuntimeError("warp-collective stand-ins need a block of whole warps")
    lane = t.thread_id % 32
    return group_collective(("warp", t.thread_id // 32), 32, lane, value, compute), lane


# --------------------------------------------------------------------------- asynchronous groups, exit checks

def async_groups(kind, t=None):
    """This thread's asynchronous operations of one kind ("cp.async"; sm90's "wgmma"): [open group
    (issued, not committed), committed groups (oldest first)]."""
    t = t or threading.current_thread()
    groups = t.__dict__.setdefault("_ptx_async", {})
    state = groups.get(kind)
    if state is None:
        state = groups[kind] = [[], []]
    return state


def commit_group(kind):
    """The open group of `kind` committed (cp.async.commit_group, wgmma.commit_group)."""
    state = async_groups(kind)
    state[1].append(state[0])
    state[0] = []


EXIT_CHECKS = []   # sm80's cp.async check and sm90's wgmma check, appended as they are imported


def check_at_exit():
    """What every simulated thread checks once its kernel body returns (target.kernel): no
    asynchronous operation left in flight (EXIT_CHECKS: sm80's cp.async, sm90's wgmma)."""
    for check in EXIT_CHECKS:
        check()
