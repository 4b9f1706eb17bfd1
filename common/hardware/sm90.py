"""Hopper (sm_90a) instructions: warpgroup MMA on shared-memory descriptors, mbarriers, bulk tensor
copies (TMA). Each GPU intrinsic (inline PTX through `common/hardware/_inline_asm.py`'s helpers) stands
beside its simulator stand-in, which has the instruction's semantics for the whole group of threads
it involves (built on common/hardware/_sim_collectives.py); `common/hardware/sm80.py` is the same for the sm_80-style
instructions (mma.sync, ldmatrix, cp.async). The tensor maps the bulk tensor copies read are made
on the host, in common/host/tensormaps.py.

| name                                     | PTX                                                       |
|------------------------------------------|-----------------------------------------------------------|
| shared_address                           | cvta.to.shared (the 32-bit address of a shared element)   |
| smem_descriptor                          | (arithmetic) a wgmma matrix descriptor, 128-byte swizzle  |
| descriptor_advance                       | (arithmetic) the same operand some bytes further on       |
| wgmma_ss(n, dtype), wgmma_rs(n, dtype)   | wgmma.mma_async.sync.aligned.m64n{n}k{16,32}.f32.{dtype}  |
| wgmma_fence, wgmma_commit, wgmma_wait(k) | wgmma.fence / commit_group / wait_group k                 |
| mbarrier_init, fence_mbarrier_init       | mbarrier.init.shared::cta.b64, fence.mbarrier_init        |
| mbarrier_arrive(_expect_tx)              | mbarrier.arrive[.expect_tx].shared::cta.b64               |
| cp_async_mbarrier_arrive                 | cp.async.mbarrier.arrive.noinc.shared::cta.b64            |
| mbarrier_try_wait, mbarrier_wait         | mbarrier.try_wait.parity.shared::cta.b64 (and its loop)   |
| tma_load_4d                              | cp.async.bulk.tensor.4d.shared::cluster.global.tile       |
| tma_store_4d                             | cp.async.bulk.tensor.4d.global.shared::cta.bulk_group     |
| tensormap_acquire                        | prefetch.tensormap; fence.proxy.tensormap::generic.acquire|
| setmaxnreg(direction, count)             | setmaxnreg.{inc,dec}.sync.aligned.u32 (a warpgroup's cap) |
| griddep_launch_dependents, griddep_wait  | griddepcontrol.launch_dependents / .wait (PDL, below)     |

Element types (`dtype`, the PTX name of a common/hardware/elements.py Element): "bf16", "f16" (16-bit, k16
an instruction) and "e4m3" (FP8, k32; both operands K-major: 8-bit wgmma has no transpose, PTX ISA
"wgmma.mma_async").

Layouts (PTX ISA, "Matrix Descriptor" and "Shared Memory Matrix Layout"): every operand tile is
stored as the bulk tensor copy lands it with SWIZZLE_128B: rows of 128 bytes (64 16-bit or 128
e4m3 elements), 16-byte chunk c of row r at chunk c ^ (r % 8), tiles 1024-byte aligned; a tile
wider than that is several such panels one after another. In descriptor terms (e = element bytes):
- K-major (the contraction index runs along the row: Q and K for S = Q K^T): element (r, k) at
  byte  (r // 8) * SBO + (r % 8) * 128 + e k  (SBO = 1024; e k < 128; LBO unused); a k-step (16
  16-bit or 32 e4m3 elements) is 32 bytes of the row in both cases,
- MN-major (the other index runs along the row: V for O = P V, read transposed): element (k, n)
  at byte  (n // 64) * LBO + 2 (n % 64) + (k // 8) * SBO + (k % 8) * 128  (LBO = the panel size),
then the swizzle applied to the whole shared address: byte a -> a ^ (((a >> 7) & 7) << 4).

Accumulators are `cuda.local.array((1, n // 8, 4), float32)`: element [0, c, j] of a thread is
row 16 w + g + 8 (j // 2), column 8 c + 2 t + (j % 2) of the warpgroup's 64 x n tile (w = warp in
the warpgroup, g = lane // 4, t = lane % 4): each warp's 16 rows laid out as the m16n8 accumulator
of mma.sync, so the tile layer's fragment helpers (softmax rows, masks, re-packing as an A operand)
apply unchanged. The register A operand of wgmma_rs is likewise per warp the A fragment of
mma.m16n8k16 (rows 16 w..16 w + 15); for e4m3 (k32) register i of a lane holds 4 bytes, byte b at
row 16 w + g + 8 (i % 2), column 4 t + b + 16 (i // 2) of the warpgroup's 64 x 32 A slice (PTX ISA,
"Register fragment layout for matrix A", .m64nNk32; CUTLASS's ALayout_64x32), which is NOT where
the accumulator holds that column: `tiles.accumulator_to_a_e4m3` says how P~ is made to fit.
"""
import threading
from functools import lru_cache

import numpy as np
from numba import uint32, uint64

from common.hardware.elements import ELEMENTS
from common.hardware.target import SIMULATOR, device_function

SWIZZLE_BYTES = 128          # the swizzle span: one row of a panel
PANEL_COLS = 64              # 16-bit elements in a 128-byte swizzled row
# the K of one wgmma of each element type, by its PTX name: 32 bytes of A's and B's rows
K_STEP = {e.ptx: e.k_step for e in ELEMENTS.values()}
SWIZZLE_ATOM_BYTES = 1024    # 8 rows x 128 bytes: the pattern's period, the tiles' alignment


def panel_columns(head_dim, element_bytes=2):
    """Columns of a tile of rows of head_dim elements laid out in whole 128-byte panels: head_dim
    rounded up to a multiple of 128 / element_bytes (64 16-bit columns). The bulk tensor copy
    zero-fills a box's columns past head_dim (past the end of the tensor map's innermost
    dimension), so the padding costs no HBM traffic, only tensor-core work on zeros."""
    cols = SWIZZLE_BYTES // element_bytes
    return -(-head_dim // cols) * cols


def _swizzle(address):
    """Byte address -> where SWIZZLE_128B puts it (host and simulator side)."""
    return address ^ (((address >> 7) & 7) << 4)


# =========================================================================== descriptors

@device_function
def smem_descriptor(address, lbo, sbo):
    """wgmma matrix descriptor of an operand at shared byte `address` with the 128-byte swizzle:
    start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29, stride byte offset >> 4 in
    32-45, base offset 0 (tiles are 1024-byte aligned), layout type 1 (SWIZZLE_128B) in 62-63."""
    lo = (uint32(address) & uint32(0x3FFFF)) >> uint32(4)
    lo = lo | ((uint32(lbo) >> uint32(4)) << uint32(16))
    hi = (uint32(sbo) >> uint32(4)) | uint32(1 << 30)
    return (uint64(hi) << uint64(32)) | uint64(lo)


@device_function
def descriptor_advance(desc, byte_offset):
    """The descriptor of the operand `byte_offset` bytes (a multiple of 16) on from `desc`'s: only
    the start address field (bits 0-13: address >> 4) changes, and a shared address is below 2^18,
    so the sum never carries out of it. Built once and advanced like this (as CUTLASS's descriptor
    iterator does), a k-step's descriptor costs one 32-bit add, where rebuilding it from the address
    cost five instructions and a move to the uniform registers (fa3's main loop in SASS: twelve
    instructions a wgmma). The add is kept 32-bit in the PTX (`_add_to_start`): written as 64-bit
    arithmetic, LLVM widens it, and ptxas re-derives the upper word every time."""
    return _add_to_start(desc, uint32(byte_offset) >> uint32(4))


def decode_descriptor(desc):
    """(start address, LBO, SBO) in bytes of a descriptor (simulator and tests)."""
    desc = int(desc)
    if desc >> 62 != 1:
        raise ValueError(f"descriptor {desc:#x}: only the 128-byte swizzle (layout type 1) is modelled")
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def operand_addresses(desc, rows, k, mn_major, element_bytes=2):
    """Byte addresses (after the swizzle) of a wgmma shared-memory operand: for K-major an array
    [row, kk] (rows x k), for MN-major [kk, n] (k x rows, 16-bit only), following the layouts of
    the header."""
    start, lbo, sbo = decode_descriptor(desc)
    r = np.arange(rows)
    kk = np.arange(k)
    if mn_major:
        addr = (start + (r[None, :] // PANEL_COLS) * lbo + 2 * (r[None, :] % PANEL_COLS)
                + (kk[:, None] // 8) * sbo + (kk[:, None] % 8) * SWIZZLE_BYTES)
    else:
        addr = (start + (r[:, None] // 8) * sbo + (r[:, None] % 8) * SWIZZLE_BYTES
                + element_bytes * kk[None, :])
    return _swizzle(addr)


# =========================================================================== simulator side

if SIMULATOR:
    from numba.cuda.simulator.kernel import _get_kernel_context

    from common.hardware import _sim_collectives as sim
    from common.hardware import lanes

    _DTYPES = {"bf16": "bfloat16", "f16": "float16", "e4m3": "e4m3"}

    def _add_to_start(desc, units):
        desc = int(desc)
        return np.uint64((desc & ~0xFFFFFFFF) | ((desc + int(units)) & 0xFFFFFFFF))
    WAIT_TIMEOUT_S = 60.0

    def _dynamic_shared():
        """The launch's dynamic shared memory as bytes (what shared addresses index here)."""
        return _get_kernel_context()._shared._dynshared.view(np.uint8)

    def shared_address(smem, offset):
        """Byte offset of element `offset` of `smem` in the dynamic shared memory (on the GPU the
        real shared address; both are 1024-aligned where the dynamic buffer starts aligned)."""
        ary = sim.unwrap(smem)
        base = _dynamic_shared()
        addr = ary.ctypes.data + int(offset) * ary.itemsize - base.ctypes.data
        if not 0 <= addr < base.size:
            raise ValueError("shared_address: not an element of the dynamic shared memory")
        return np.uint32(addr)

    def _values_at(addresses, dtype):
        """The elements of type `dtype` at the given shared byte addresses, as float64."""
        mem = _dynamic_shared()
        a = np.asarray(addresses, dtype=np.int64)
        size = 1 if dtype == "e4m3" else 2
        if a.size and (a.min() < 0 or a.max() + size > mem.size or (a % size).any()):
            raise ValueError("a wgmma operand reaches outside shared memory or is misaligned")
        if dtype == "e4m3":
            return lanes.bytes_to_float(mem[a])
        return lanes.halves_to_float(mem[a].astype(np.uint16) | (mem[a + 1].astype(np.uint16) << 8),
                                     dtype)

    def stmatrix_x4(smem, offset, r0, r1, r2, r3):
        """stmatrix.sync.aligned.m8n8.x4.shared.b16: lanes.stmatrix_lanes over the warp's lanes,
        offset in smem's 16-bit elements."""
        ary = sim.unwrap(smem)
        sim.warp_collective((int(offset), int(r0), int(r1), int(r2), int(r3)),
                            lambda ops: lanes.stmatrix_lanes(ary, [o[0] for o in ops],
                                                             [o[1:] for o in ops]))

    def _warpgroup():
        t = threading.current_thread()
        return t.thread_id // 128, t.thread_id % 128

    def _accumulator_rows_cols(n):
        """Row and column in the 64 x n tile of each thread's accumulator element, (128, n/2)."""
        tid = np.arange(128)[:, None]
        i = np.arange(n // 2)[None, :]
        warp, lane = tid // 32, tid % 32
        row = 16 * warp + lane // 4 + 8 * ((i % 4) // 2)
        col = 8 * (i // 4) + 2 * (lane % 4) + (i % 2)
        return row, col

    _LANE = np.arange(32)[:, None, None]
    _REG = np.arange(4)[None, :, None]
    _BYTE = np.arange(4)[None, None, :]
    # e4m3 A (k32): byte b of register i of a lane, row g + 8 (i % 2), column 4 t + b + 16 (i // 2)
    _A8_ROW = np.broadcast_to(_LANE // 4 + 8 * (_REG % 2), (32, 4, 4))
    _A8_COL = np.broadcast_to(4 * (_LANE % 4) + _BYTE + 16 * (_REG // 2), (32, 4, 4))

    def _a_from_registers(regs, dtype):
        """(128, 4) uint32 A registers of a warpgroup -> its 64 x k A operand."""
        regs = np.asarray(regs, dtype=np.uint32)
        if dtype == "e4m3":
            a = np.zeros((64, 32))
            for w in range(4):
                bytes_ = np.ascontiguousarray(regs[32 * w:32 * w + 32]).view(np.uint8).reshape(32, 4, 4)
                a[16 * w + _A8_ROW, _A8_COL] = lanes.bytes_to_float(bytes_)
            return a
        return np.concatenate([lanes.a_fragment_matrix(regs[32 * w:32 * w + 32], dtype)
                               for w in range(4)])

    def _wgmma_apply(ops, n, dtype, a_regs, trans_b, trans_a=False):
        """D = A B (+ D): ops[i] = (acc array, A registers or descriptor, B descriptor, scale_d);
        A read MN-major (M x K given as K rows of M) when trans_a."""
        k, size = (32, 1) if dtype == "e4m3" else (16, 2)
        if a_regs:
            a = _a_from_registers([op[1] for op in ops], dtype)
        elif trans_a:
            a = _values_at(operand_addresses(ops[0][1], 64, k, True, size), dtype).T
        else:
            a = _values_at(operand_addresses(ops[0][1], 64, k, False, size), dtype)
        b = _values_at(operand_addresses(ops[0][2], n, k, trans_b, size), dtype)
        b = b if trans_b else b.T                       # K x N
        row, col = _accumulator_rows_cols(n)
        d = a @ b
        for tid, op in enumerate(ops):
            acc = op[0].reshape(-1)
            new = d[row[tid], col[tid]]
            if op[3]:
                new = new + acc.astype(np.float64)
            acc[:] = new.astype(np.float32)

    # wgmma is asynchronous: a warpgroup's MMAs run between their issue and the wgmma_wait that
    # covers their commit group, reading their shared-memory operands and writing their
    # accumulators at some time in between. The stand-in does them at the latest, in the wait (as
    # sm80's cp.async lands copies at their wait): an accumulator read before its wait sees
    # the old value, and a tile overwritten (or a stage released to the producer) before the wait
    # is read after the change, deterministically, where a GPU would race. It also makes the
    # warpgroup meet once a wait rather than once an MMA (the simulator's cost). A thread whose
    # kernel returns with MMAs not waited for is an error (check_wgmma_waited).

    def _wgmma_state():
        """This thread's wgmmas: [open group (issued, not committed), committed groups]."""
        return sim.async_groups("wgmma")

    def _make_wgmma(n, dtype, a_regs, trans_b, trans_a=False):
        dt = _DTYPES[dtype]

        def compute(ops):
            if len({(op[1] if not a_regs else None, op[2], bool(op[3])) for op in ops}) != 1:
                raise RuntimeError("the threads of a warpgroup disagree on a wgmma's descriptors")
            _wgmma_apply(ops, n, dt, a_regs, trans_b, trans_a)

        if a_regs:
            def wgmma(acc, a0, a1, a2, a3, desc_b, scale_d):
                _wgmma_state()[0].append(
                    (compute, (sim.unwrap(acc), (a0, a1, a2, a3), int(desc_b), int(scale_d))))
        else:
            def wgmma(acc, desc_a, desc_b, scale_d):
                _wgmma_state()[0].append(
                    (compute, (sim.unwrap(acc), int(desc_a), int(desc_b), int(scale_d))))
        wgmma.__name__ = wgmma.__qualname__ = _wgmma_name(n, dtype, a_regs, trans_b, trans_a)
        return wgmma

    def wgmma_fence():
        pass

    def wgmma_commit():
        sim.commit_group("wgmma")

    def _run_groups(per_thread):
        """The warpgroup's MMAs of the groups a wait covers: per_thread[tid] = its groups, each a
        list of (compute, operands); the threads must have issued the same MMAs."""
        shape = {tuple(tuple(op[0] for op in g) for g in groups) for groups in per_thread}
        if len(shape) != 1:
            raise RuntimeError("the threads of a warpgroup issued different wgmmas before a wait")
        for g, group in enumerate(per_thread[0]):
            for j, (compute, _) in enumerate(group):
                compute([groups[g][j][1] for groups in per_thread])

    def _make_wait(pending, counts):
        def wait(*accs):
            committed = _wgmma_state()[1]
            due = len(committed) - pending
            if due <= 0:
                return
            groups, committed[:due] = committed[:due], []
            wg, i = _warpgroup()
            sim.group_collective(("wgmma", wg), 128, i, groups, _run_groups,
                                 always_own_barrier=True)
        wait.__name__ = wait.__qualname__ = f"wgmma_wait{pending}_" + "_".join(map(str, counts))
        return wait

    def check_wgmma_waited():
        """Raise if this thread issued wgmmas that no wgmma_wait covered before its kernel
        returned (on a GPU their accumulators would be written at an unknown time)."""
        open_group, committed = _wgmma_state()
        if open_group or committed:
            raise RuntimeError(
                f"wgmma issued but never waited for before the kernel returned: thread "
                f"{getattr(threading.current_thread(), 'thread_id', '?')} has "
                f"{sum(map(len, committed))} in committed groups and {len(open_group)} uncommitted "
                "(wgmma_commit, then wgmma_wait)")

    sim.EXIT_CHECKS.append(check_wgmma_waited)

    # ------------------------------------------------------------------ mbarriers

    class _MBarrier:
        """An mbarrier: `count` arrivals and `tx` transaction bytes complete the current phase."""

        def __init__(self, count):
            self.count, self.pending, self.tx, self.phase = count, count, 0, 0
            self.cond = threading.Condition()

        def _complete_if_done(self):
            if self.pending == 0 and self.tx == 0:
                self.phase += 1
                self.pending = self.count
                self.cond.notify_all()

        def arrive(self, tx=0):
            with self.cond:
                if self.pending == 0:
                    raise RuntimeError("mbarrier: more arrivals than its count in one phase")
                self.tx += tx
                self.pending -= 1
                self._complete_if_done()

        def complete_tx(self, nbytes):
            with self.cond:
                self.tx -= nbytes
                self._complete_if_done()

        def wait_parity(self, parity, where):
            with self.cond:
                done = self.cond.wait_for(lambda: (self.phase & 1) != parity, WAIT_TIMEOUT_S)
            if not done:
                raise RuntimeError(
                    f"mbarrier at shared byte {where}: phase of parity {parity} not completed after "
                    f"{WAIT_TIMEOUT_S:.0f} s ({self.pending} arrivals and {self.tx} transaction "
                    "bytes missing): a missing arrive, or expect_tx bytes the copies never reach")
            return True

    def _barriers():
        return sim.block_state()["groups"].setdefault(("mbarriers",), {})

    def _barrier(smem, offset):
        addr = int(shared_address(smem, offset))
        bar = _barriers().get(addr)
        if bar is None:
            raise RuntimeError(f"mbarrier at shared byte {addr} used before mbarrier_init")
        return bar, addr

    def mbarrier_init(smem, offset, count):
        addr = int(shared_address(smem, offset))
        if addr % 8:
            raise ValueError("an mbarrier must be 8-byte aligned")
        sim.independent_groups()
        _barriers()[addr] = _MBarrier(int(count))

    def griddep_launch_dependents():
        """Programmatic dependent launch: nothing to overlap in the simulator, which runs one
        grid at a time."""

    def griddep_wait():
        """The grid before this one on the stream has ended here (the simulator's grids run one
        after another)."""

    def fence_mbarrier_init():
        pass

    def mbarrier_arrive(smem, offset):
        _barrier(smem, offset)[0].arrive()

    def mbarrier_arrive_expect_tx(smem, offset, nbytes):
        _barrier(smem, offset)[0].arrive(int(nbytes))

    def cp_async_mbarrier_arrive(smem, offset):
        """An arrival on the mbarrier once every cp.async copy this thread has issued so far has
        landed (committed or not; .noinc: the arrival counts against the barrier's count). Here
        the copies land now, then the arrival: one of the orders a GPU may take."""
        from common.hardware import sm80
        sm80.cp_async_commit()
        sm80.cp_async_wait(0)
        _barrier(smem, offset)[0].arrive()

    def mbarrier_try_wait(smem, offset, parity):
        """Blocks until the phase completes (a GPU try_wait may return false first and be
        retried); after WAIT_TIMEOUT_S raises an error naming what is missing (a GPU would hang)."""
        bar, addr = _barrier(smem, offset)
        return bar.wait_parity(int(parity) & 1, addr)

    # ------------------------------------------------------------------ bulk tensor copies

    _TENSOR_MAPS = {}     # id -> (4-D array, box rows, box cols), what a simulated map stands for
    _next_map = [1]

    def register_tensor_map(view, box_rows, box_cols):
        """The 16 words the kernel gets for a tensor map over `view` (common/host/tensormaps.py makes
        them): here the first word names the array in a registry (_TENSOR_MAPS)."""
        key = _next_map[0]
        _next_map[0] += 1
        _TENSOR_MAPS[key] = (sim.unwrap(view.array), int(box_rows), int(box_cols))
        words = np.zeros(16, np.uint64)
        words[0] = key
        return words

    def tensormap_acquire(tmaps, i):
        pass

    def _make_setmaxnreg(direction, count):
        def setmaxnreg():
            pass   # registers are not modelled
        return setmaxnreg

    def tma_load_4d(dst, dst_offset, tmaps, i, c0, c1, c2, c3, bar_smem, bar_offset):
        """Box [c3, c2, c1:c1+rows, c0:c0+cols] of the map's (B, H, N, d) array (zeros past its
        end) into shared memory at dst with the 128-byte swizzle, then complete_tx of the box's
        bytes on the barrier."""
        src, rows, cols = _TENSOR_MAPS[int(sim.unwrap(tmaps)[int(i), 0])]
        box = np.zeros((rows, cols), src.dtype)
        r0, col0 = int(c1), int(c0)
        part = src[int(c3), int(c2), r0:r0 + rows, col0:col0 + cols]
        box[:part.shape[0], :part.shape[1]] = part
        start = int(shared_address(dst, dst_offset))
        if start % SWIZZLE_ATOM_BYTES or cols * src.itemsize != SWIZZLE_BYTES:
            raise ValueError("a 128-byte-swizzled box is 128 bytes wide at a 1024-aligned address")
        addr = _swizzle(start + np.arange(rows)[:, None] * SWIZZLE_BYTES
                        + np.arange(SWIZZLE_BYTES)[None, :])
        _dynamic_shared()[addr] = np.ascontiguousarray(box).view(np.uint8)
        _barrier(bar_smem, bar_offset)[0].complete_tx(rows * SWIZZLE_BYTES)

    def tma_store_4d(tmaps, i, c0, c1, c2, c3, src, src_offset):
        """The box [c3, c2, c1:c1+rows, c0:c0+cols] of the map's (B, H, N, d) array <- the
        128-byte-swizzled box at src (tma_load_4d's layout), clipped at the array's ends. Queued in
        the issuing thread's bulk group (sm80.bulk_store's rule): it reads shared memory and lands
        at the bulk_wait_read or bulk_wait that covers it."""
        dst, rows, cols = _TENSOR_MAPS[int(sim.unwrap(tmaps)[int(i), 0])]
        start = int(shared_address(src, src_offset))
        if start % SWIZZLE_ATOM_BYTES or cols * dst.itemsize != SWIZZLE_BYTES:
            raise ValueError("a 128-byte-swizzled box is 128 bytes wide at a 1024-aligned address")
        r0, col0, h, b = int(c1), int(c0), int(c2), int(c3)
        addr = _swizzle(start + np.arange(rows)[:, None] * SWIZZLE_BYTES
                        + np.arange(SWIZZLE_BYTES)[None, :])
        shared = _dynamic_shared()

        def land():
            box = np.ascontiguousarray(shared[addr]).view(dst.dtype)
            part = dst[b, h, r0:r0 + rows, col0:col0 + cols]
            part[...] = box[:part.shape[0], :part.shape[1]]
        sim.async_groups("bulk")[0].append(land)

# =========================================================================== GPU side

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from common.hardware._inline_asm import (
        _as,
        _asm,
        _f32,
        _i32,
        _i64,
        _item_pointer,
        _make_statement,
        _shared_address,
    )

    @intrinsic
    def shared_address(typingctx, smem, offset):
        sig = types.uint32(smem, offset)

        def codegen(context, builder, sig, args):
            return _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])

        return sig, codegen

    @intrinsic
    def _add_to_start(typingctx, desc, units):
        """desc + units in the descriptor's lower 32-bit word alone (add.u32 on that half)."""
        sig = types.uint64(desc, units)

        def codegen(context, builder, sig, args):
            ops = [_as(context, builder, args[0], sig.args[0], types.uint64),
                   _as(context, builder, args[1], sig.args[1], types.uint32)]
            return _asm(builder, _i64, ops, "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; "
                        "add.u32 lo, lo, $2; mov.b64 $0, {lo, hi}; }", "=l,l,r")

        return sig, codegen

    def _acc_pointers(context, builder, aryty, aryval, count):
        ary = context.make_array(aryty)(context, builder, aryval)
        return [builder.gep(ary.data, [ir.Constant(_i32, i)]) for i in range(count)]

    def _make_wgmma(n, dtype, a_regs, trans_b, trans_a=False):
        count = n // 2
        d = ",".join(f"${i}" for i in range(count))
        # 8-bit types have no transpose immediates (imm-trans-a, imm-trans-b): K-major only
        trans = "" if dtype == "e4m3" else \
            (f", {int(trans_b)}" if a_regs else f", {int(trans_a)}, {int(trans_b)}")
        if a_regs:
            a = "{" + ",".join(f"${count + i}" for i in range(4)) + "}"
            b, scale = f"${count + 4}", f"${count + 5}"
            ins = ["r", "r", "r", "r", "l", "r"]
        else:
            a, b, scale = f"${count}", f"${count + 1}", f"${count + 2}"
            ins = ["l", "l", "r"]
        tail = "p, 1, 1" + trans
        text = (f"{{ .reg .pred p; setp.ne.b32 p, {scale}, 0; "
                f"wgmma.mma_async.sync.aligned.m64n{n}k{K_STEP[dtype]}.f32.{dtype}.{dtype} "
                f"{{{d}}}, {a}, {b}, {tail}; }}")
        # the accumulators: outputs $0.., and (after the other inputs) the same registers as inputs
        constraints = ",".join(["=f"] * count + ins + [str(i) for i in range(count)])

        def codegen(context, builder, sig, args):
            ptrs = _acc_pointers(context, builder, sig.args[0], args[0], count)
            accs = [builder.load(p) for p in ptrs]
            if a_regs:
                ops = [_as(context, builder, v, t, types.uint32) for v, t in zip(args[1:5], sig.args[1:5])]
                ops += [_as(context, builder, args[5], sig.args[5], types.uint64),
                        _as(context, builder, args[6], sig.args[6], types.int32)]
            else:
                ops = [_as(context, builder, args[1], sig.args[1], types.uint64),
                       _as(context, builder, args[2], sig.args[2], types.uint64),
                       _as(context, builder, args[3], sig.args[3], types.int32)]
            out = _asm(builder, [_f32] * count, ops + accs, text, constraints, side_effect=True)
            for i, p in enumerate(ptrs):
                builder.store(builder.extract_value(out, i), p)
            return context.get_dummy_value()

        if a_regs:
            @intrinsic
            def wgmma(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
                return types.void(acc, a0, a1, a2, a3, desc_b, scale_d), codegen
        else:
            @intrinsic
            def wgmma(typingctx, acc, desc_a, desc_b, scale_d):
                return types.void(acc, desc_a, desc_b, scale_d), codegen
        wgmma.cache_name = _wgmma_name(n, dtype, a_regs, trans_b, trans_a)
        return wgmma

    wgmma_fence = _make_statement("wgmma.fence.sync.aligned;")
    wgmma_commit = _make_statement("wgmma.commit_group.sync.aligned;")
    fence_mbarrier_init = _make_statement("fence.mbarrier_init.release.cluster;")
    # Programmatic dependent launch (PTX ISA "griddepcontrol"; CUDA's
    # cudaTriggerProgrammaticLaunchCompletion / cudaGridDependencySynchronize): a kernel launched
    # with the programmatic-serialization attribute (common.host.launching.launch(..., programmatic=True))
    # may start while the kernel before it on the stream still runs, once each of that kernel's
    # blocks has run launch_dependents (or exited); its griddep_wait returns when that kernel has
    # ended and its memory operations are visible. In a kernel launched without the attribute the
    # wait returns at once, and launch_dependents with no such dependent does nothing.
    griddep_launch_dependents = _make_statement(
        "griddepcontrol.launch_dependents;", "Let the next, programmatic launch on the stream start.")
    griddep_wait = _make_statement(
        "griddepcontrol.wait;", "Wait until the grid this one depends on has ended, its memory "
        "visible.")

    def _make_wait(pending, counts):
        text = f"wgmma.wait_group.sync.aligned {pending};"

        def codegen(context, builder, sig, args):
            ptrs, kinds = [], []
            for aryty, aryval, count in zip(sig.args, args, counts):
                ptrs += _acc_pointers(context, builder, aryty, aryval, count)
                f32 = aryty.dtype == types.float32   # accumulators; else 32-bit A registers
                kinds += [(_f32, "f") if f32 else (_i32, "r")] * count
            if not ptrs:
                _asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)
                return context.get_dummy_value()
            constraints = ",".join([f"={c}" for _, c in kinds] + [str(i) for i in range(len(ptrs))]
                                   + ["~{memory}"])
            out = _asm(builder, [t for t, _ in kinds], [builder.load(p) for p in ptrs], text,
                       constraints, side_effect=True)
            for i, p in enumerate(ptrs):
                builder.store(builder.extract_value(out, i), p)
            return context.get_dummy_value()

        if len(counts) == 0:
            @intrinsic
            def wait(typingctx):
                return types.void(), codegen
        elif len(counts) == 1:
            @intrinsic
            def wait(typingctx, acc):
                return types.void(acc), codegen
        elif len(counts) == 2:
            @intrinsic
            def wait(typingctx, acc, acc2):
                return types.void(acc, acc2), codegen
        elif len(counts) == 3:
            @intrinsic
            def wait(typingctx, acc, acc2, acc3):
                return types.void(acc, acc2, acc3), codegen
        elif len(counts) == 4:
            @intrinsic
            def wait(typingctx, acc, acc2, acc3, acc4):
                return types.void(acc, acc2, acc3, acc4), codegen
        else:
            @intrinsic
            def wait(typingctx, acc, acc2, acc3, acc4, acc5):
                return types.void(acc, acc2, acc3, acc4, acc5), codegen
        wait.cache_name = f"wgmma_wait{pending}_" + "_".join(map(str, counts))
        return wait

    @intrinsic
    def stmatrix_x4(typingctx, smem, offset, r0, r1, r2, r3):
        """Four 8x8 matrices of 16-bit elements to shared memory, a row address a lane (lanes
        8i..8i+7: matrix i's rows), register i of each lane two elements of a row of matrix i
        (lanes.stmatrix_lanes); offset in smem's elements."""
        sig = types.void(smem, offset, r0, r1, r2, r3)

        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            regs = [_as(context, builder, v, t, types.uint32) for v, t in zip(args[2:], sig.args[2:])]
            _asm(builder, ir.VoidType(), [addr] + regs,
                 "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1,$2,$3,$4};",
                 "r,r,r,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    def _make_setmaxnreg(direction, count):
        instruction = _make_statement(f"setmaxnreg.{direction}.sync.aligned.u32 {count};")
        instruction.cache_name = f"setmaxnreg_{direction}_{count}"
        return instruction

    def _mbarrier_op(text, returns=False):
        """An instruction on the mbarrier at smem[offset] (its shared address $0, or $1 when the
        instruction returns a 32-bit value in $0) with one 32-bit operand after it, or none."""
        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            ops = [addr] + [_as(context, builder, v, t, types.uint32)
                            for v, t in zip(args[2:], sig.args[2:])]
            regs = ",".join(["r"] * len(ops)) + ",~{memory}"
            if returns:
                return _asm(builder, _i32, ops, text, "=r," + regs, side_effect=True)
            _asm(builder, ir.VoidType(), ops, text, regs, side_effect=True)
            return context.get_dummy_value()

        if "$1" not in text:
            @intrinsic
            def op(typingctx, smem, offset):
                return types.void(smem, offset), codegen
        else:
            @intrinsic
            def op(typingctx, smem, offset, value):
                return (types.uint32 if returns else types.void)(smem, offset, value), codegen
        return op

    mbarrier_init = _mbarrier_op("mbarrier.init.shared::cta.b64 [$0], $1;")
    mbarrier_arrive = _mbarrier_op("mbarrier.arrive.shared::cta.b64 _, [$0];")
    mbarrier_arrive_expect_tx = _mbarrier_op(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;")
    cp_async_mbarrier_arrive = _mbarrier_op("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];")
    mbarrier_try_wait = _mbarrier_op(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
        "selp.u32 $0, 1, 0, p; }", returns=True)

    def _tmap_address(context, builder, aryty, aryval, index, index_type):
        zero = context.get_constant(types.intp, 0)
        ptr = _item_pointer(context, builder, aryty, aryval, [index, zero], [index_type, types.intp])
        # the generic address of the map (kept in an ordinary global array): the copy's operand
        return builder.ptrtoint(ptr, _i64)

    @intrinsic
    def tensormap_acquire(typingctx, tmaps, i):
        sig = types.void(tmaps, i)

        def codegen(context, builder, sig, args):
            t = _tmap_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            _asm(builder, ir.VoidType(), [t],
                 "prefetch.tensormap [$0]; fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
                 "l,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def tma_load_4d(typingctx, dst, dst_offset, tmaps, i, c0, c1, c2, c3, bar_smem, bar_offset):
        sig = types.void(dst, dst_offset, tmaps, i, c0, c1, c2, c3, bar_smem, bar_offset)

        def codegen(context, builder, sig, args):
            d = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            t = _tmap_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            cs = [_as(context, builder, v, ty, types.int32) for v, ty in zip(args[4:8], sig.args[4:8])]
            bar = _shared_address(context, builder, sig.args[8], args[8], args[9], sig.args[9])
            _asm(builder, ir.VoidType(), [d, t] + cs + [bar],
                 "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[$0], [$1, {$2, $3, $4, $5}], [$6];", "r,l,r,r,r,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen


    @intrinsic
    def tma_store_4d(typingctx, tmaps, i, c0, c1, c2, c3, src, src_offset):
        sig = types.void(tmaps, i, c0, c1, c2, c3, src, src_offset)

        def codegen(context, builder, sig, args):
            t = _tmap_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            cs = [_as(context, builder, v, ty, types.int32) for v, ty in zip(args[2:6], sig.args[2:6])]
            s = _shared_address(context, builder, sig.args[6], args[6], args[7], sig.args[7])
            _asm(builder, ir.VoidType(), [t] + cs + [s],
                 "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [$0, {$1, $2, $3, $4}], "
                 "[$5];", "l,r,r,r,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen


def _wgmma_name(n, dtype, a_regs, trans_b, trans_a=False):
    return (f"wgmma_m64n{n}k{K_STEP[dtype]}_{dtype}_{'rs' if a_regs else 'ss'}"
            f"{'_ta' if trans_a else ''}{'_tb' if trans_b else ''}")


def _check_wgmma(n, dtype, trans_b, trans_a=False):
    if dtype not in K_STEP:
        raise ValueError(f"wgmma element type {dtype!r}: one of {', '.join(K_STEP)}")
    if dtype == "e4m3" and (trans_b or trans_a):
        raise ValueError("e4m3 wgmma reads A and B K-major only (no transpose for 8-bit types)")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N={n}: a multiple of 8 from 8 to 256")


@lru_cache(maxsize=None)
def wgmma_ss(n, dtype, trans_b=False, trans_a=False):
    """wgmma(acc, desc_a, desc_b, scale_d): acc (64 x n a warpgroup, fp32) = A B + (acc if scale_d
    else 0), A (64 x k) and B (k x n) both read from shared memory through descriptors (A K-major,
    i.e. given as 64 rows of k, unless trans_a: k rows of 64, the MN-major layout of the header;
    B K-major, i.e. given as n rows of k, unless trans_b); k = K_STEP[dtype]."""
    _check_wgmma(n, dtype, trans_b, trans_a)
    return _make_wgmma(n, dtype, False, trans_b, trans_a)


@lru_cache(maxsize=None)
def wgmma_rs(n, dtype, trans_b=True):
    """wgmma(acc, a0, a1, a2, a3, desc_b, scale_d): as wgmma_ss with A from registers (each warp
    its 16 rows as an mma.m16n8k16 A fragment, or for e4m3 the k32 layout of the header); B
    MN-major (k rows of n) unless trans_b=False (always so for e4m3)."""
    _check_wgmma(n, dtype, trans_b)
    return _make_wgmma(n, dtype, True, trans_b)


@lru_cache(maxsize=None)
def wgmma_wait(pending, *counts):
    """wait(acc, ...): wgmma.wait_group `pending` (at most that many committed groups still in
    flight), for register arrays of `counts` elements a thread: fp32 accumulators (n/2 for
    m64n{n}) or the uint32 A registers of an RS-wgmma. They pass through the instruction, so the
    compiler neither reads an accumulator nor reuses an operand's registers before it. At most
    five arrays."""
    if len(counts) > 5:
        raise ValueError(f"wgmma_wait takes at most 5 register arrays, got {len(counts)}")
    return _make_wait(pending, counts)


@device_function
def mbarrier_wait(smem, offset, parity):
    """Wait until the phase of parity `parity` of the mbarrier at smem[offset] has completed."""
    while not mbarrier_try_wait(smem, offset, parity):
        pass


@lru_cache(maxsize=None)
def setmaxnreg(direction, count):
    """An instruction (no arguments) that sets the executing warpgroup's registers a thread to
    `count` ("inc" waits until the registers are free, "dec" frees them). Every warp of the
    warpgroup executes it; the kernel needs launch bounds so that its entry count is fixed."""
    if direction not in ("inc", "dec") or count % 8 or not 24 <= count <= 256:
        raise ValueError(f"setmaxnreg: {direction!r} {count} (inc/dec, a multiple of 8 in 24..256)")
    return _make_setmaxnreg(direction, count)
