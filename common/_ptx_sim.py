"""Pure-Python stand-ins for `common/_ptx_gpu.py`, used under NUMBA_ENABLE_CUDASIM=1.

Each stand-in has the name, arguments and per-lane result of its intrinsic, so one kernel source
runs on the GPU and in Numba's CUDA simulator. The lane-level semantics are written once, as NumPy
functions over all 32 lanes (`mma_lanes`, `ldmatrix_lanes`); the stand-ins call them, and the GPU
tests compare the real instructions against them.

Warp-collective stand-ins (mma, ldmatrix, shuffles) must see the other lanes' registers. The
simulator runs every CUDA thread as a Python thread, so a stand-in publishes its operand and waits
at the simulator's block barrier (`_warp_collective`). Consequence, checked by the simulator itself
(it deadlocks or raises otherwise): in simulated kernels every thread of the block must reach the
same sequence of warp-collective calls. The kernels of this project are written that way.
"""
import itertools
import threading

import ml_dtypes
import numpy as np

from common import _sim_block

# --------------------------------------------------------------------------- lane semantics
# PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type": with g = lane // 4 and
# t = lane % 4, register j of a lane holds two consecutive 16-bit elements (low half first):
#   A (16x16, row-major): a0 (g, 2t), a1 (g+8, 2t), a2 (g, 2t+8), a3 (g+8, 2t+8)
#   B (16x8,  "col"):     b0 (k=2t, n=g), b1 (k=2t+8, n=g)      (the pair runs along k)
#   C, D (16x8, f32):     c0,c1 (g, 2t), (g, 2t+1); c2,c3 (g+8, 2t), (g+8, 2t+1)

_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def halves_to_float(bits, dtype):
    """uint16 bit patterns -> float64 values of a 16-bit float type ('bfloat16' or 'float16')."""
    return np.asarray(bits, dtype=np.uint16).view(_DTYPES[dtype]).astype(np.float64)


def float_to_halves(x, dtype):
    """float values -> uint16 bit patterns, rounded to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(_DTYPES[dtype]).view(np.uint16)


E4M3_MAX = 448.0


def bytes_to_float(bits):
    """uint8 bit patterns of float8_e4m3fn -> float64 values."""
    return np.asarray(bits, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def float_to_e4m3(x):
    """fp32 values -> float8_e4m3fn bit patterns as cvt.rn.satfinite does it: rounded to nearest
    even, clamped to +-448 (the largest finite e4m3; the format has no infinity), NaN kept."""
    x = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


# (row, col) of the 16-bit halves of each lane's registers, in register order (low half first).
_A_ROW = np.stack([_G, _G, _G + 8, _G + 8, _G, _G, _G + 8, _G + 8], axis=1)
_A_COL = np.stack([2 * _T, 2 * _T + 1] * 2 + [2 * _T + 8, 2 * _T + 9] * 2, axis=1)
_B_K = np.stack([2 * _T, 2 * _T + 1, 2 * _T + 8, 2 * _T + 9], axis=1)
_B_N = np.stack([_G] * 4, axis=1)
_C_ROW = np.stack([_G, _G, _G + 8, _G + 8], axis=1)
_C_COL = np.stack([2 * _T, 2 * _T + 1] * 2, axis=1)


def _halves(regs):
    """(32, r) uint32 registers -> (32, 2r) uint16 halves, low half first."""
    return np.ascontiguousarray(regs, dtype=np.uint32).view(np.uint16)


def a_fragment_matrix(a_regs, dtype):
    """32 lanes x 4 uint32 A registers -> the 16x16 matrix they hold."""
    a = np.zeros((16, 16))
    a[_A_ROW, _A_COL] = halves_to_float(_halves(a_regs), dtype)
    return a


def b_fragment_matrix(b_regs, dtype):
    """32 lanes x 2 uint32 B registers -> the 16x8 (k x n) matrix they hold."""
    b = np.zeros((16, 8))
    b[_B_K, _B_N] = halves_to_float(_halves(b_regs), dtype)
    return b


def c_fragment_matrix(c_regs):
    """32 lanes x 4 f32 C/D registers -> the 16x8 matrix they hold."""
    c = np.zeros((16, 8))
    c[_C_ROW, _C_COL] = np.asarray(c_regs, dtype=np.float64)
    return c


def c_fragment_registers(c):
    """16x8 matrix -> the 32 lanes x 4 f32 registers of the C/D fragment."""
    return np.asarray(c, dtype=np.float64)[_C_ROW, _C_COL].astype(np.float32)


def mma_lanes(a_regs, b_regs, c_regs, dtype):
    """D = A B + C for mma.m16n8k16 over the registers of all 32 lanes (fp32 accumulate)."""
    a = a_fragment_matrix(a_regs, dtype)
    b = b_fragment_matrix(b_regs, dtype)
    return c_fragment_registers(a @ b + c_fragment_matrix(c_regs))


def ldmatrix_lanes(smem, offsets, trans):
    """ldmatrix.x4 (.trans): lanes 8i..8i+7 give the 8 row offsets of 8x8 matrix i; register i of
    lane l gets elements (l//4, 2(l%4)) and (l//4, 2(l%4)+1) of matrix i, or with .trans
    (2(l%4), l//4) and (2(l%4)+1, l//4)."""
    smem = np.asarray(smem).view(np.uint16)
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.zeros((32, 4), dtype=np.uint32)
    for i in range(4):
        rows = offsets[8 * i:8 * i + 8]
        if trans:
            lo = smem[rows[2 * _T] + _G]
            hi = smem[rows[2 * _T + 1] + _G]
        else:
            lo = smem[rows[_G] + 2 * _T]
            hi = smem[rows[_G] + 2 * _T + 1]
        out[:, i] = lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)
    return out


# --------------------------------------------------------------------------- warp exchange

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


def _warp_collective(value, compute=None):
    """group_collective over the 32 lanes of this thread's warp: returns (result, lane)."""
    t = threading.current_thread()
    if not hasattr(t, "_manager"):
        raise RuntimeError("PTX stand-ins run only inside a kernel launched in the CUDA simulator")
    bx, by, bz = t._manager._block_dim
    if (bx * by * bz) % 32:
        raise RuntimeError("warp-collective stand-ins need a block of whole warps")
    lane = t.thread_id % 32
    return group_collective(("warp", t.thread_id // 32), 32, lane, value, compute), lane


# --------------------------------------------------------------------------- stand-ins

def _make_mma(dtype):
    def compute(ops):
        regs = np.array(ops, dtype=np.float64)
        return mma_lanes(regs[:, 0:4].astype(np.uint32), regs[:, 4:6].astype(np.uint32),
                         regs[:, 6:10], dtype)

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        d, lane = _warp_collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), compute)
        return (d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3])

    mma.__name__ = mma.__qualname__ = f"mma_{dtype}_16816"
    return mma


mma_bf16_16816 = _make_mma("bfloat16")
mma_f16_16816 = _make_mma("float16")


def _unwrap(ary):
    """The NumPy array behind a simulator array (shared and local arrays already are NumPy)."""
    if isinstance(ary, np.ndarray):
        return ary
    ary = vars(ary).get("_item", ary)  # FakeWithinKernelCUDAArray wraps a FakeCUDAArray
    return vars(ary)["_ary"]


def _make_ldmatrix(trans):
    def ldmatrix(smem, offset):
        smem = _unwrap(smem)
        regs, lane = _warp_collective(int(offset), lambda offs: ldmatrix_lanes(smem, offs, trans))
        return (regs[lane, 0], regs[lane, 1], regs[lane, 2], regs[lane, 3])

    return ldmatrix


ldmatrix_x4 = _make_ldmatrix(trans=False)
ldmatrix_x4_trans = _make_ldmatrix(trans=True)


def shfl_xor_f32(x, lanemask):
    values, lane = _warp_collective(np.float32(x))
    return np.float32(values[lane ^ int(lanemask)])


def broadcast_u32(x):
    values, lane = _warp_collective(np.uint32(x))
    return np.uint32(values[0])


def ex2_approx(x):
    with np.errstate(over="ignore"):
        return np.float32(np.exp2(np.float32(x)))


def rcp_approx(x):
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1) / np.float32(x))


def _make_pack(dtype):
    def pack(lo, hi):
        bits = float_to_halves([lo, hi], dtype).astype(np.uint32)
        return np.uint32(bits[0] | (bits[1] << 16))

    return pack


pack_bf16x2 = _make_pack("bfloat16")
pack_f16x2 = _make_pack("float16")


def pack_e4m3x4(x0, x1, x2, x3):
    """Four fp32 values -> one register of four e4m3 bytes, x0 in the lowest byte."""
    b = float_to_e4m3([x0, x1, x2, x3]).astype(np.uint32)
    return np.uint32(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24))


def _make_unpack(dtype):
    def unpack(word):
        w = int(word)
        lo, hi = halves_to_float([w & 0xFFFF, w >> 16], dtype)
        return np.float32(lo), np.float32(hi)

    return unpack


unpack_bf16x2 = _make_unpack("bfloat16")
unpack_f16x2 = _make_unpack("float16")


def syncwarp():
    """All 32 lanes meet here, so that one lane may hand what the others stored in shared memory to
    something that is not a warp collective (lane 0's bulk reduction)."""
    _warp_collective(None)


NAMED_BARRIER_TIMEOUT_S = 60.0


class _NamedBarrier:
    """bar.sync / bar.arrive on one named barrier: a phase completes when `size` threads have
    reached it; those that sync wait for that, those that arrive run on."""
    __slots__ = ("size", "count", "phase", "cond", "arrived")

    def __init__(self, size):
        self.size, self.count, self.phase = size, 0, 0
        self.cond = threading.Condition()
        self.arrived = set()   # the threads that bar.arrive'd into the current phase

    def reach(self, barrier, wait):
        with self.cond:
            me = threading.get_ident()
            if not wait:   # a second bar.arrive of one thread in one phase would, on a GPU, count
                if me in self.arrived:   # into it too, completing it without the threads that
                    raise RuntimeError(  # were to meet there (a bar.arrive then a bar.sync of
                        # the same threads is a phase they complete alone, on purpose)
                        f"named barrier {barrier} ({self.size} threads): a thread arrived twice in "
                        "one phase (the other side never synced between: the protocol lets one "
                        "side run a phase ahead)")
                self.arrived.add(me)
            phase = self.phase
            self.count += 1
            if self.count == self.size:
                self.count, self.phase = 0, phase + 1
                self.arrived = set()
                self.cond.notify_all()
            elif wait and not self.cond.wait_for(lambda: self.phase != phase,
                                                 NAMED_BARRIER_TIMEOUT_S):
                raise RuntimeError(f"named barrier {barrier} ({self.size} threads): only "
                                   f"{self.count} arrived in {NAMED_BARRIER_TIMEOUT_S:.0f} s (a "
                                   "bar.arrive or bar.sync is missing)")


def _named_barrier(barrier, nthreads):
    state = block_state()
    if not state.get("independent", False):
        return None
    named = state.setdefault("named", {})
    with _setup_lock:
        bar = named.get(barrier)
        if bar is None:
            bar = named[barrier] = _NamedBarrier(nthreads)
    if bar.size != nthreads:
        raise RuntimeError(f"named barrier {barrier} used with {nthreads} threads, earlier with "
                           f"{bar.size}")
    return bar


def bar_sync(barrier, nthreads):
    """A named barrier: the first `nthreads` threads to reach barrier `barrier` (by bar_sync or
    bar_arrive) meet; those of bar_sync wait for the rest (the others of the block run on, as on
    the GPU)."""
    bar = _named_barrier(int(barrier), int(nthreads))
    if bar is None:
        group_collective(("bar", int(barrier)), int(nthreads), 0, None)
    else:
        bar.reach(int(barrier), wait=True)


def bar_arrive(barrier, nthreads):
    """Count this thread into the current phase of named barrier `barrier` and run on (the
    producer side of a bar_sync elsewhere)."""
    bar = _named_barrier(int(barrier), int(nthreads))
    if bar is None:
        raise RuntimeError("bar_arrive needs independent_groups() (a warp-specialised kernel): the "
                           "simulator's block-barrier mode cannot let a thread pass a barrier")
    bar.reach(int(barrier), wait=False)


# cp.async: a copy lands only at the cp_async_wait that covers it. Each simulated thread keeps the
# copies it has issued (destination, offset, the 8 source values read at issue, or zeros) in its
# open group; cp_async_commit closes that group, cp_async_wait(n) writes out every committed group
# but the newest n, oldest first (cp.async.wait_group n; the open group is not waited for). On a GPU
# a copy lands at some time up to that wait; landing it at the latest makes a read that misses a
# wait see stale data, and a store into the tile before the wait be overwritten, deterministically.
# A thread whose kernel returns with copies still in flight is an error (check_cp_async_landed,
# called by target.kernel after the body): they would land at an unknown time.

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


def cp_async_16(dst, dst_offset, src, row, col, src_bytes):
    dst = _unwrap(dst)
    if int(src_bytes) == 16:
        values = _unwrap(src)[int(row), int(col):int(col) + 8].copy()
    else:
        values = np.zeros(8, dtype=dst.dtype)
    async_groups("cp.async")[0].append((dst, int(dst_offset), values))


class _Address:
    """What global_address stands for in the simulator: an element of an array, moved by adding
    whole row pitches in bytes (as the kernels do with the 64-bit address on a GPU)."""
    __slots__ = ("ary", "row", "col")

    def __init__(self, ary, row, col):
        self.ary, self.row, self.col = ary, int(row), int(col)

    def __add__(self, nbytes):
        rows, rest = divmod(int(nbytes), self.ary.strides[0])
        if rest:
            raise ValueError("a global address moves by whole rows only")
        return _Address(self.ary, self.row + rows, self.col)

    __radd__ = __add__


def global_address(src, row, col):
    return _Address(_unwrap(src), row, col)


def cp_async_16_from(dst, dst_offset, address, src_bytes):
    cp_async_16(dst, dst_offset, address.ary, address.row, address.col, src_bytes)


def cp_async_commit():
    commit_group("cp.async")


def cp_async_wait(pending):
    committed = async_groups("cp.async")[1]
    while len(committed) > int(pending):
        for dst, o, values in committed.pop(0):
            dst[o:o + 8] = values


def check_at_exit():
    """What every simulated thread checks once its kernel body returns (target.kernel): no
    asynchronous operation left in flight (EXIT_CHECKS: cp.async here; wgmma, sm90's)."""
    for check in EXIT_CHECKS:
        check()


def check_cp_async_landed():
    """Raise if this thread has cp.async copies that no cp_async_wait has covered (its kernel is
    returning: on a GPU they would land at an unknown time, maybe over what it stored since)."""
    open_group, committed = async_groups("cp.async")
    waiting = sum(len(g) for g in committed)
    if open_group or waiting:
        t = threading.current_thread()
        offsets = [o for g in committed + [open_group] for _, o, _ in g][:4]
        raise RuntimeError(
            "cp.async copies issued but never waited for (cp_async_wait) before the kernel "
            f"returned: thread {getattr(t, 'thread_id', '?')} has {waiting} in committed groups "
            f"and {len(open_group)} uncommitted (destination offsets {offsets}...)")


EXIT_CHECKS = [check_cp_async_landed]


def ld_shared_v4_u32(smem, offset):
    o = int(offset)
    return tuple(np.uint32(x) for x in _unwrap(smem)[o:o + 4])


def st_shared_u32(smem, offset, x):
    _unwrap(smem)[int(offset)] = np.uint32(x)


def st_global_v4_u32(dst, row, col, x0, x1, x2, x3):
    c = int(col)
    _unwrap(dst)[int(row), c:c + 4] = (x0, x1, x2, x3)


_RED_LOCK = threading.Lock()


def red_add_v2_f32(dst, row, col, x0, x1):
    """dst[row, col] += x0 and dst[row, col + 1] += x1, atomically (other threads add too)."""
    a, r, c = _unwrap(dst), int(row), int(col)
    with _RED_LOCK:
        a[r, c] += np.float32(x0)
        a[r, c + 1] += np.float32(x1)


def st_shared_v4_f32(smem, offset, x0, x1, x2, x3):
    o = int(offset)
    _unwrap(smem)[o:o + 4] = (np.float32(x0), np.float32(x1), np.float32(x2), np.float32(x3))


def bulk_reduce_add_f32(dst, row, src, src_offset, nbytes):
    """The nbytes / 4 floats of dst from (row, 0) on (dst contiguous: they may span rows) +=
    src[o:o + nbytes / 4]: done at once (the simulator has no copy engine; the kernels call it only
    after the barrier that makes the source final)."""
    n, o = int(nbytes) // 4, int(src_offset)
    a = _unwrap(dst)
    if int(nbytes) % 16 or o % 4 or not a.flags.c_contiguous:
        raise ValueError("a bulk reduction moves whole 16-byte units from a 16-byte aligned "
                         "source into contiguous memory")
    start = int(row) * a.shape[1]
    with _RED_LOCK:
        a.reshape(-1)[start:start + n] += _unwrap(src)[o:o + n].astype(np.float32)


def bulk_commit():
    pass


def fence_proxy_async_shared():
    pass


def bulk_wait_read(pending):
    pass


def bulk_wait(pending):
    pass
