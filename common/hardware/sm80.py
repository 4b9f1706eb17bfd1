"""The sm_80-style instructions (mma.sync, ldmatrix, cp.async, shuffles, cvt; and the few sm_90
vector and bulk reductions fa2's backward uses), one Python name each. The kernels call them
through `common.hardware.ptx` (`from common.hardware import ptx`; `ptx.mma_bf16_16816(...)`), which re-exports
these names.

One source for both targets, as common/hardware/sm90.py is for the Hopper instructions (the pick made once
at import by NUMBA_ENABLE_CUDASIM), but interleaved finer, by instruction family: each section
holds the family's simulator stand-ins (`if SIMULATOR:`) right above their GPU intrinsics (inline
PTX through common/hardware/_inline_asm.py's helpers), so an instruction's PTX and its stand-in read
together, and the factory calls that make both (`_make_mma("bf16")`) are written once, after
them. A stand-in has its intrinsic's name, arguments and per-lane result, so every kernel runs
unchanged in Numba's CUDA simulator.

What is no single instruction's lives in three modules of its own, each shared with sm90.py:
common/hardware/lanes.py (the lane-level semantics in NumPy, which the stand-ins compute with and the GPU
tests check the real instructions against: importable without the simulator),
common/hardware/_sim_collectives.py (the simulator machinery: warp and group collectives, asynchronous
groups, exit checks) and common/hardware/_inline_asm.py (the inline-PTX codegen helpers).

| name                                 | PTX                                                    |
|--------------------------------------|--------------------------------------------------------|
| mma_bf16_16816, mma_f16_16816        | mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}       |
| ldmatrix_x4, ldmatrix_x4_trans       | ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16       |
| shfl_xor_f32, shfl_xor_u32           | shfl.sync.bfly.b32                                     |
| broadcast_u32                        | shfl.sync.idx.b32 from lane 0: the compiler then knows |
|                                      | the value is warp-uniform (uniform registers)          |
| ex2_approx                           | ex2.approx.ftz.f32                                     |
| rcp_approx                           | rcp.approx.ftz.f32                                     |
| ex2_poly                             | 2^x in 9 FP32/ALU instructions, no MUFU (FA4's         |
|                                      | software exp2: add.rm to floor, 3 fma, shl, mul.ftz)   |
| prmt                                 | prmt.b32: 4 of 8 bytes, by a selector in a register    |
| pack_bf16x2, pack_f16x2              | cvt.rn.{bf16x2,f16x2}.f32                              |
| pack_e4m3x4                          | cvt.rn.satfinite.e4m3x2.f32 (x2): four fp32 -> e4m3    |
| unpack_bf16x2, unpack_f16x2          | mov.b32 {lo, hi}; cvt.f32.{bf16,f16} (both halves)     |
| syncwarp                             | bar.warp.sync                                          |
| bar_sync                             | bar.sync (a named barrier over some of the warps)      |
| bar_arrive                           | bar.arrive (count into a named barrier, do not wait)   |
| cp_async_16, cp_async_commit, _wait  | cp.async.cg.shared.global (16 B, zero-fill), groups    |
| global_address, cp_async_16_from     | the same copy from a 64-bit address computed once      |
| ld_shared_v4_u32, st_global_v4_u32   | ld.shared.v4.b32, st.global.v4.b32                     |
| ld_global_v4_u32                     | ld.global.v4.b32 (of a 4-D array's last dimension)     |
| st_shared_u32                        | st.shared.b32                                          |
| red_add_v2_f32                       | red.global.add.v2.f32 (sm_90: two fp32 adds at once)   |
| red_add_v2_f32_at                    | the same at a global_address plus whole rows, + cols   |
| st_shared_v4_f32                     | st.shared.v4.f32                                       |
| bulk_reduce_add_f32                  | cp.reduce.async.bulk.global.shared::cta...add.f32      |
| bulk_store                           | cp.async.bulk.global.shared::cta.bulk_group (sm_90)    |
| bulk_commit, bulk_wait_read, _wait   | cp.async.bulk.commit_group, .wait_group[.read] (sm_90) |
| fence_proxy_async_shared             | fence.proxy.async.shared::cta                          |

Operands: shared memory as (1-D shared array, element offset), global memory as (2-D array, row,
col); see common/hardware/_inline_asm.py for how the intrinsics emit them.

In the simulator, warp-collective stand-ins (mma, ldmatrix, shuffles, syncwarp) meet the other
lanes at a barrier (common/hardware/_sim_collectives.py), so every thread of a simulated block must reach
the same sequence of warp-collective calls (the kernels of this project are written that way; the
simulator deadlocks or raises otherwise). cp.async copies land at the cp_async_wait that covers
them (see that section).
"""
from common.hardware.target import SIMULATOR

if SIMULATOR:
    import threading

    import numpy as np

    from common.hardware import lanes
    from common.hardware._sim_collectives import (
        EXIT_CHECKS,
        async_groups,
        block_state,
        commit_group,
        group_collective,
        unwrap,
        warp_collective,
    )

    _LANE_DTYPES = {"bf16": "bfloat16", "f16": "float16"}   # PTX type -> common.hardware.lanes' name
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from common.hardware import lanes
    from common.hardware._inline_asm import (
        _as,
        _asm,
        _f32,
        _global_address,
        _i32,
        _make_statement,
        _shared_address,
        _statement,
        _unpack,
    )


# =========================================================================== tensor cores

if SIMULATOR:
    def _make_mma(ptx_type):
        dtype = _LANE_DTYPES[ptx_type]

        def compute(ops):
            regs = np.array(ops, dtype=np.float64)
            return lanes.mma_lanes(regs[:, 0:4].astype(np.uint32), regs[:, 4:6].astype(np.uint32),
                                   regs[:, 6:10], dtype)

        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            d, lane = warp_collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), compute)
            return (d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3])

        mma.__name__ = mma.__qualname__ = f"mma_{ptx_type}_16816"
        return mma

    def _make_ldmatrix(trans):
        def ldmatrix(smem, offset):
            smem = unwrap(smem)
            regs, lane = warp_collective(int(offset),
                                         lambda offs: lanes.ldmatrix_lanes(smem, offs, trans))
            return (regs[lane, 0], regs[lane, 1], regs[lane, 2], regs[lane, 3])

        return ldmatrix
else:
    def _make_mma(ptx_type):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            ins = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            sig = types.UniTuple(types.float32, 4)(*ins)

            def codegen(context, builder, sig, args):
                ops = [_as(context, builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
                ops += [_as(context, builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
                out = _asm(builder, [_f32] * 4, ops, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                return context.make_tuple(builder, sig.return_type, _unpack(builder, out, 4))

            return sig, codegen

        return mma

    def _make_ldmatrix(trans):
        text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "")
                + ".shared.b16 {$0,$1,$2,$3}, [$4];")

        @intrinsic
        def ldmatrix(typingctx, smem, offset):
            sig = types.UniTuple(types.uint32, 4)(smem, offset)

            def codegen(context, builder, sig, args):
                addr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                out = _asm(builder, [_i32] * 4, [addr], text, "=r,=r,=r,=r,r", side_effect=True)
                return context.make_tuple(builder, sig.return_type, _unpack(builder, out, 4))

            return sig, codegen

        return ldmatrix


mma_bf16_16816 = _make_mma("bf16")
mma_f16_16816 = _make_mma("f16")
ldmatrix_x4 = _make_ldmatrix(trans=False)
ldmatrix_x4_trans = _make_ldmatrix(trans=True)


# =========================================================================== warp shuffles

if SIMULATOR:
    def shfl_xor_f32(x, lanemask):
        values, lane = warp_collective(np.float32(x))
        return np.float32(values[lane ^ int(lanemask)])

    def broadcast_u32(x):
        values, lane = warp_collective(np.uint32(x))
        return np.uint32(values[0])

    def shfl_xor_u32(x, lanemask):
        values, lane = warp_collective(np.uint32(x))
        return np.uint32(values[lane ^ int(lanemask)])
else:
    @intrinsic
    def shfl_xor_f32(typingctx, x, lanemask):
        sig = types.float32(x, lanemask)

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], types.float32)
            m = _as(context, builder, args[1], sig.args[1], types.int32)
            return _asm(builder, _f32, [v, m], "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;",
                        "=f,f,r", side_effect=True)

        return sig, codegen

    @intrinsic
    def shfl_xor_u32(typingctx, x, lanemask):
        sig = types.uint32(x, lanemask)

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], types.uint32)
            m = _as(context, builder, args[1], sig.args[1], types.int32)
            return _asm(builder, _i32, [v, m], "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;",
                        "=r,r,r", side_effect=True)

        return sig, codegen

    @intrinsic
    def broadcast_u32(typingctx, x):
        sig = types.uint32(x)

        def codegen(context, builder, sig, args):
            v = _as(context, builder, args[0], sig.args[0], types.uint32)
            return _asm(builder, _i32, [v], "shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r",
                        side_effect=True)   # warp-synchronous: kept where the converged warp calls it

        return sig, codegen


# =========================================================================== math

if SIMULATOR:
    def ex2_approx(x):
        with np.errstate(over="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def rcp_approx(x):
        with np.errstate(divide="ignore"):
            return np.float32(np.float32(1) / np.float32(x))

    def ex2_poly(x):
        return np.float32(lanes.ex2_poly(x))
else:
    def _make_f32_unary(text):
        """fp32 $0 = f($1): pure arithmetic, left free to schedule."""
        @intrinsic
        def unary(typingctx, x):
            sig = types.float32(x)

            def codegen(context, builder, sig, args):
                v = _as(context, builder, args[0], sig.args[0], types.float32)
                return _asm(builder, _f32, [v], text, "=f,f")

            return sig, codegen

        return unary

    ex2_approx = _make_f32_unary("ex2.approx.ftz.f32 $0, $1;")
    rcp_approx = _make_f32_unary("rcp.approx.ftz.f32 $0, $1;")

    def _f32_hex(value):
        import struct
        return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]

    # 2^x off the MUFU unit (lanes.ex2_poly is the specification): add.rm of 1.5 * 2^23 + 127
    # rounds x down to an integer in the low bits of r, biased by 127 (the exponent's bias); f =
    # x - floor(x); 2^f by Horner's rule; r << 23 is then the fp32 bit pattern of 2^floor(x)
    # (the magic number's own bits shift out), +0 for floor(x) = -127, whose product with 2^f is
    # then exactly 0.
    _MAGIC = _f32_hex(1.5 * 2 ** 23 + 127)
    ex2_poly = _make_f32_unary(
        "{ .reg .f32 xc, r, n, f, p; .reg .b32 e;\n"
        f"max.f32 xc, $1, {_f32_hex(lanes.EX2_POLY_FLOOR)};\n"
        f"add.rm.f32 r, xc, {_MAGIC};\n"
        f"sub.f32 n, r, {_MAGIC};\n"
        "sub.f32 f, xc, n;\n"
        f"fma.rn.f32 p, f, {_f32_hex(lanes.EX2_POLY[3])}, {_f32_hex(lanes.EX2_POLY[2])};\n"
        f"fma.rn.f32 p, p, f, {_f32_hex(lanes.EX2_POLY[1])};\n"
        f"fma.rn.f32 p, p, f, {_f32_hex(lanes.EX2_POLY[0])};\n"
        "mov.b32 e, r;\n"
        "shl.b32 e, e, 23;\n"
        "mov.b32 r, e;\n"
        "mul.ftz.f32 $0, p, r; }")


if SIMULATOR:
    def prmt(a, b, selector):
        """prmt.b32 with a selector in a register: byte i of the result is byte
        (selector >> 4 i) & 7 of the 8 bytes b:a (a's bytes 0-3, b's 4-7), or, when bit 3 of
        that nibble is set, that byte's sign bit replicated (0x00 or 0xFF)."""
        both, sel, out = int(a) | (int(b) << 32), int(selector), 0
        for i in range(4):
            nibble = (sel >> (4 * i)) & 15
            byte = (both >> (8 * (nibble & 7))) & 0xFF
            if nibble & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * i)
        return np.uint32(out)
else:
    @intrinsic
    def prmt(typingctx, a, b, selector):
        sig = types.uint32(a, b, selector)

        def codegen(context, builder, sig, args):
            ops = [_as(context, builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
            return _asm(builder, _i32, ops, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")

        return sig, codegen


# =========================================================================== conversions

if SIMULATOR:
    def _make_pack(ptx_type):
        dtype = _LANE_DTYPES[ptx_type]

        def pack(lo, hi):
            bits = lanes.float_to_halves([lo, hi], dtype).astype(np.uint32)
            return np.uint32(bits[0] | (bits[1] << 16))

        return pack

    def pack_e4m3x4(x0, x1, x2, x3):
        """Four fp32 values -> one register of four e4m3 bytes, x0 in the lowest byte."""
        b = lanes.float_to_e4m3([x0, x1, x2, x3]).astype(np.uint32)
        return np.uint32(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24))

    def _make_unpack(ptx_type):
        dtype = _LANE_DTYPES[ptx_type]

        def unpack(word):
            w = int(word)
            lo, hi = lanes.halves_to_float([w & 0xFFFF, w >> 16], dtype)
            return np.float32(lo), np.float32(hi)

        return unpack
else:
    def _make_pack(ptx_type):
        # cvt.rn.<t>x2.f32 d, a, b puts cvt(a) in the upper half of d and cvt(b) in the lower half.
        text = f"cvt.rn.{ptx_type}x2.f32 $0, $1, $2;"

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(lo, hi)

            def codegen(context, builder, sig, args):
                lo_ = _as(context, builder, args[0], sig.args[0], types.float32)
                hi_ = _as(context, builder, args[1], sig.args[1], types.float32)
                return _asm(builder, _i32, [hi_, lo_], text, "=r,f,f")

            return sig, codegen

        return pack

    @intrinsic
    def pack_e4m3x4(typingctx, x0, x1, x2, x3):
        """Two cvt.rn.satfinite.e4m3x2.f32 (sm_89+; d = {cvt(a) high byte, cvt(b) low byte}) and a
        mov of the two 16-bit halves: x0 lands in the register's lowest byte (lowest address)."""
        sig = types.uint32(x0, x1, x2, x3)
        text = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")

        def codegen(context, builder, sig, args):
            xs = [_as(context, builder, a, t, types.float32) for a, t in zip(args, sig.args)]
            return _asm(builder, _i32, xs, text, "=r,f,f,f,f")

        return sig, codegen

    def _make_unpack(ptx_type):
        text = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                f"cvt.f32.{ptx_type} $0, lo; cvt.f32.{ptx_type} $1, hi; }}")

        @intrinsic
        def unpack(typingctx, word):
            sig = types.UniTuple(types.float32, 2)(word)

            def codegen(context, builder, sig, args):
                w = _as(context, builder, args[0], sig.args[0], types.uint32)
                out = _asm(builder, [_f32] * 2, [w], text, "=f,=f,r")
                return context.make_tuple(builder, sig.return_type, _unpack(builder, out, 2))

            return sig, codegen

        return unpack


pack_bf16x2 = _make_pack("bf16")
pack_f16x2 = _make_pack("f16")
unpack_bf16x2 = _make_unpack("bf16")
unpack_f16x2 = _make_unpack("f16")


# =========================================================================== barriers

NAMED_BARRIER_TIMEOUT_S = 60.0   # the simulator's: a named barrier not met by then raises

if SIMULATOR:
    _named_lock = threading.Lock()

    def syncwarp():
        """All 32 lanes meet here, so that one lane may hand what the others stored in shared
        memory to something that is not a warp collective (lane 0's bulk reduction)."""
        warp_collective(None)

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
                            f"named barrier {barrier} ({self.size} threads): a thread arrived twice "
                            "in one phase (the other side never synced between: the protocol lets "
                            "one side run a phase ahead)")
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
        with _named_lock:
            bar = named.get(barrier)
            if bar is None:
                bar = named[barrier] = _NamedBarrier(nthreads)
        if bar.size != nthreads:
            raise RuntimeError(f"named barrier {barrier} used with {nthreads} threads, earlier with "
                               f"{bar.size}")
        return bar

    def bar_sync(barrier, nthreads):
        """A named barrier: the first `nthreads` threads to reach barrier `barrier` (by bar_sync or
        bar_arrive) meet; those of bar_sync wait for the rest (the others of the block run on, as
        on the GPU)."""
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
            raise RuntimeError("bar_arrive needs independent_groups() (a warp-specialised kernel): "
                               "the simulator's block-barrier mode cannot let a thread pass a barrier")
        bar.reach(int(barrier), wait=False)
else:
    syncwarp = _make_statement("bar.warp.sync -1;", "All 32 lanes reach this point, and their "
                               "shared-memory writes before it are visible to the warp's reads after "
                               "it.")

    @intrinsic
    def bar_sync(typingctx, barrier, nthreads):
        """Named barrier `barrier` (1..15; 0 is __syncthreads') for the `nthreads` threads (whole
        warps) that use it: they all reach this point, and their shared-memory writes before it are
        visible to their reads after it (bar.sync a, b)."""
        def codegen(context, builder, sig, args):
            ops = [_as(context, builder, v, t, types.int32) for v, t in zip(args, sig.args)]
            _asm(builder, ir.VoidType(), ops, "bar.sync $0, $1;", "r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.void(barrier, nthreads), codegen

    @intrinsic
    def bar_arrive(typingctx, barrier, nthreads):
        """Count this thread's warp into named barrier `barrier` of `nthreads` threads without
        waiting (bar.arrive a, b): the threads that bar_sync on it wait for these arrivals too.
        Shared-memory writes before it are visible to the syncing threads after their bar_sync."""
        def codegen(context, builder, sig, args):
            ops = [_as(context, builder, v, t, types.int32) for v, t in zip(args, sig.args)]
            _asm(builder, ir.VoidType(), ops, "bar.arrive $0, $1;", "r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.void(barrier, nthreads), codegen


# =========================================================================== asynchronous copies
# In the simulator a copy lands only at the cp_async_wait that covers it. Each simulated thread
# keeps the copies it has issued (destination, offset, the 8 source values read at issue, or zeros)
# in its open group; cp_async_commit closes that group, cp_async_wait(n) writes out every committed
# group but the newest n, oldest first (cp.async.wait_group n; the open group is not waited for). On
# a GPU a copy lands at some time up to that wait; landing it at the latest makes a read that misses
# a wait see stale data, and a store into the tile before the wait be overwritten,
# deterministically. A thread whose kernel returns with copies still in flight is an error
# (check_cp_async_landed, one of the checks target.kernel runs after the body): they would land at
# an unknown time.

if SIMULATOR:
    def cp_async_16(dst, dst_offset, src, row, col, src_bytes):
        dst, ary, r, c = unwrap(dst), unwrap(src), int(row), int(col)
        # The address must lie inside the source even for a zero fill (src_bytes = 0), which reads
        # nothing but is still an address the copy is given (an empty source has none to give).
        if ary.shape[0] and not (0 <= r < ary.shape[0] and 0 <= c and c + 8 <= ary.shape[1]):
            raise IndexError(f"cp.async source [{r}, {c}:{c + 8}] outside the {ary.shape} array "
                             f"({int(src_bytes)} bytes)")
        if int(src_bytes) == 16:
            values = ary[r, c:c + 8].copy()
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
        return _Address(unwrap(src), row, col)

    def cp_async_16_from(dst, dst_offset, address, src_bytes):
        cp_async_16(dst, dst_offset, address.ary, address.row, address.col, src_bytes)

    def cp_async_commit():
        commit_group("cp.async")

    def cp_async_wait(pending):
        committed = async_groups("cp.async")[1]
        while len(committed) > int(pending):
            for dst, o, values in committed.pop(0):
                dst[o:o + 8] = values

    def check_cp_async_landed():
        """Raise if this thread has cp.async copies that no cp_async_wait has covered (its kernel
        is returning: on a GPU they would land at an unknown time, maybe over what it stored
        since)."""
        open_group, committed = async_groups("cp.async")
        waiting = sum(len(g) for g in committed)
        if open_group or waiting:
            t = threading.current_thread()
            offsets = [o for g in committed + [open_group] for _, o, _ in g][:4]
            raise RuntimeError(
                "cp.async copies issued but never waited for (cp_async_wait) before the kernel "
                f"returned: thread {getattr(t, 'thread_id', '?')} has {waiting} in committed groups "
                f"and {len(open_group)} uncommitted (destination offsets {offsets}...)")

    EXIT_CHECKS.append(check_cp_async_landed)
else:
    @intrinsic
    def cp_async_16(typingctx, dst, dst_offset, src, row, col, src_bytes):
        """16-byte global->shared copy of src[row, col:col+8]; bytes past `src_bytes` (0 or 16) are
        filled with zeros."""
        sig = types.void(dst, dst_offset, src, row, col, src_bytes)

        def codegen(context, builder, sig, args):
            saddr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            gaddr = _global_address(context, builder, sig.args[2], args[2], args[3:5], sig.args[3:5])
            n = _as(context, builder, args[5], sig.args[5], types.int32)
            _asm(builder, ir.VoidType(), [saddr, gaddr, n],
                 "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def global_address(typingctx, src, row, col):
        """The 64-bit `.global` address of src[row, col] (arithmetic only: nothing is read)."""
        sig = types.int64(src, row, col)

        def codegen(context, builder, sig, args):
            return _global_address(context, builder, sig.args[0], args[0], args[1:3], sig.args[1:3])

        return sig, codegen

    @intrinsic
    def cp_async_16_from(typingctx, dst, dst_offset, address, src_bytes):
        """cp_async_16 from a 64-bit global address (global_address plus whole row pitches: a tile
        copy's address arithmetic done once, not per chunk)."""
        sig = types.void(dst, dst_offset, address, src_bytes)

        def codegen(context, builder, sig, args):
            saddr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            gaddr = _as(context, builder, args[2], sig.args[2], types.int64)
            n = _as(context, builder, args[3], sig.args[3], types.int32)
            _asm(builder, ir.VoidType(), [saddr, gaddr, n],
                 "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    cp_async_commit = _make_statement("cp.async.commit_group;",
                                      "Close the group of cp.async copies issued since the last commit.")

    @intrinsic
    def cp_async_wait(typingctx, pending):
        """Wait until at most `pending` (a literal int) committed copy groups are still in flight."""
        if not isinstance(pending, types.IntegerLiteral):
            return None
        n = pending.literal_value
        sig = types.void(pending)

        def codegen(context, builder, sig, args):
            _statement(builder, f"cp.async.wait_group {n};")
            return context.get_dummy_value()

        return sig, codegen


# =========================================================================== 16-byte accesses, reductions

if SIMULATOR:
    _RED_LOCK = threading.Lock()

    def ld_shared_v4_u32(smem, offset):
        o = int(offset)
        return tuple(np.uint32(x) for x in unwrap(smem)[o:o + 4])

    def st_shared_u32(smem, offset, x):
        unwrap(smem)[int(offset)] = np.uint32(x)

    def st_global_v4_u32(dst, row, col, x0, x1, x2, x3):
        c = int(col)
        unwrap(dst)[int(row), c:c + 4] = (x0, x1, x2, x3)

    def ld_global_v4_u32(src, i, j, k, col):
        """The GPU's rules too: the four words inside the row, their address 16-byte aligned (a
        misaligned vector load is a fatal error there)."""
        a, c = unwrap(src), int(col)
        index = (int(i), int(j), int(k), c)
        if not 0 <= c <= a.shape[3] - 4:
            raise IndexError(f"a 16-byte load of words {c}..{c + 3} runs past a row of {a.shape[3]}")
        address = a.ctypes.data + sum(x * s for x, s in zip(index, a.strides))
        if address % 16:
            raise ValueError(f"a 16-byte load at {index} is not 16-byte aligned (byte strides "
                             f"{a.strides})")
        return tuple(np.uint32(x) for x in a[index[0], index[1], index[2], c:c + 4])

    def red_add_v2_f32(dst, row, col, x0, x1):
        """dst[row, col] += x0 and dst[row, col + 1] += x1, atomically (other threads add too)."""
        a, r, c = unwrap(dst), int(row), int(col)
        with _RED_LOCK:
            a[r, c] += np.float32(x0)
            a[r, c + 1] += np.float32(x1)

    def red_add_v2_f32_at(address, col, x0, x1):
        """red_add_v2_f32 at `address` (global_address, moved by whole rows) + `col` columns."""
        red_add_v2_f32(address.ary, address.row, address.col + int(col), x0, x1)
else:
    @intrinsic
    def ld_shared_v4_u32(typingctx, smem, offset):
        sig = types.UniTuple(types.uint32, 4)(smem, offset)

        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            out = _asm(builder, [_i32] * 4, [addr], "ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];",
                       "=r,=r,=r,=r,r", side_effect=True)
            return context.make_tuple(builder, sig.return_type, _unpack(builder, out, 4))

        return sig, codegen

    @intrinsic
    def st_shared_u32(typingctx, smem, offset, x):
        """smem[offset] = x, one 32-bit shared store at a 32-bit address (no 64-bit index math and
        no negative-index wrap-around, which an indexed store of a signed offset costs)."""
        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            val = _as(context, builder, args[2], sig.args[2], types.uint32)
            _asm(builder, ir.VoidType(), [addr, val], "st.shared.b32 [$0], $1;", "r,r,~{memory}",
                 side_effect=True)
            return context.get_dummy_value()

        return types.void(smem, offset, x), codegen

    def _global_vector_op(context, builder, sig, args, value_type, text, constraints):
        """Emit `text` with $0 = the 64-bit address of dst[row, col] (args[0:3]) and $1.. = the
        values args[3:] as `value_type`."""
        addr = _global_address(context, builder, sig.args[0], args[0], args[1:3], sig.args[1:3])
        vals = [_as(context, builder, v, t, value_type) for v, t in zip(args[3:], sig.args[3:])]
        _asm(builder, ir.VoidType(), [addr] + vals, text, constraints, side_effect=True)
        return context.get_dummy_value()

    @intrinsic
    def st_global_v4_u32(typingctx, dst, row, col, x0, x1, x2, x3):
        """dst[row, col:col+4] = (x0, x1, x2, x3), one 16-byte store."""
        def codegen(context, builder, sig, args):
            return _global_vector_op(context, builder, sig, args, types.uint32,
                                     "st.global.v4.b32 [$0], {$1,$2,$3,$4};", "l,r,r,r,r,~{memory}")

        return types.void(dst, row, col, x0, x1, x2, x3), codegen

    @intrinsic
    def ld_global_v4_u32(typingctx, src, i, j, k, col):
        """src[i, j, k, col:col+4] of a 4-D uint32 array, one 16-byte load (16-byte aligned: col
        a multiple of 4, the row's address a multiple of 16 bytes)."""
        sig = types.UniTuple(types.uint32, 4)(src, i, j, k, col)

        def codegen(context, builder, sig, args):
            addr = _global_address(context, builder, sig.args[0], args[0], args[1:5], sig.args[1:5])
            out = _asm(builder, [_i32] * 4, [addr], "ld.global.v4.b32 {$0,$1,$2,$3}, [$4];",
                       "=r,=r,=r,=r,l", side_effect=True)
            return context.make_tuple(builder, sig.return_type, _unpack(builder, out, 4))

        return sig, codegen

    @intrinsic
    def red_add_v2_f32(typingctx, dst, row, col, x0, x1):
        """dst[row, col:col+2] += (x0, x1), one vector reduction (sm_90; 8-byte aligned)."""
        def codegen(context, builder, sig, args):
            return _global_vector_op(context, builder, sig, args, types.float32,
                                     "red.global.add.v2.f32 [$0], {$1,$2};", "l,f,f,~{memory}")

        return types.void(dst, row, col, x0, x1), codegen

    @intrinsic
    def red_add_v2_f32_at(typingctx, address, col, x0, x1):
        """red_add_v2_f32 at a 64-bit address from global_address (moved by whole row pitches)
        plus `col` fp32 columns: a row's address computed once for all its reductions."""
        def codegen(context, builder, sig, args):
            addr = _as(context, builder, args[0], sig.args[0], types.int64)
            off = _as(context, builder, args[1], sig.args[1], types.int64)
            addr = builder.add(addr, builder.mul(off, ir.Constant(off.type, 4)))
            vals = [_as(context, builder, v, t, types.float32) for v, t in zip(args[2:], sig.args[2:])]
            _asm(builder, ir.VoidType(), [addr] + vals, "red.global.add.v2.f32 [$0], {$1,$2};",
                 "l,f,f,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.void(address, col, x0, x1), codegen


# =========================================================================== bulk reductions (sm_90)

if SIMULATOR:
    def st_shared_v4_f32(smem, offset, x0, x1, x2, x3):
        o = int(offset)
        unwrap(smem)[o:o + 4] = (np.float32(x0), np.float32(x1), np.float32(x2), np.float32(x3))

    def bulk_reduce_add_f32(dst, row, src, src_offset, nbytes):
        """The nbytes / 4 floats of dst from (row, 0) on (dst contiguous: they may span rows) +=
        src[o:o + nbytes / 4]: done at once (the simulator has no copy engine; the kernels call it
        only after the barrier that makes the source final)."""
        n, o = int(nbytes) // 4, int(src_offset)
        a = unwrap(dst)
        if int(nbytes) % 16 or o % 4 or not a.flags.c_contiguous:
            raise ValueError("a bulk reduction moves whole 16-byte units from a 16-byte aligned "
                             "source into contiguous memory")
        start = int(row) * a.shape[1]
        with _RED_LOCK:
            a.reshape(-1)[start:start + n] += unwrap(src)[o:o + n].astype(np.float32)

    # A bulk store is queued in the issuing thread's open group ("bulk"), bulk_commit closes it,
    # and it reads its source and lands only at the bulk_wait_read or bulk_wait that covers it:
    # the latest a GPU may read the source, so a kernel that restages the source before that wait
    # copies the new data, deterministically, and one that never waits leaves the copy unmade
    # (and fails check_bulk_landed). The bulk reductions above are applied at once.
    def bulk_store(address, src, src_offset, nbytes):
        """The nbytes at `address` (global_address of 32-bit words, moved by whole rows) =
        src[o:o + nbytes / 4] (32-bit words), when a bulk wait covers it."""
        n, o = int(nbytes) // 4, int(src_offset)
        a, r, c = address.ary, address.row, address.col
        s = unwrap(src)
        if int(nbytes) % 16 or o % 4 or c % 4 or a.strides[0] % 16 or a.itemsize != 4 \
                or s.itemsize != 4 or not 0 <= r < a.shape[0] or c + n > a.shape[1]:
            raise ValueError("a bulk store moves whole 16-byte units from a 16-byte aligned source "
                             "into one row of its 16-byte aligned destination (32-bit words)")
        def land():
            a[r, c:c + n] = s[o:o + n]
        async_groups("bulk")[0].append(land)

    def _bulk_land(pending):
        """Every bulk group but the newest `pending` lands (each entry of a group, a bulk store or
        sm90's tensor store, is the function that makes its copy)."""
        committed = async_groups("bulk")[1]
        while len(committed) > int(pending):
            for land in committed.pop(0):
                land()

    def check_bulk_landed():
        """Raise if this thread has bulk stores that no bulk wait has covered (its kernel is
        returning: on a GPU the block's shared memory, their source, would be gone)."""
        open_group, committed = async_groups("bulk")
        waiting = sum(len(g) for g in committed)
        if open_group or waiting:
            raise RuntimeError(f"bulk stores issued but never waited for (bulk_wait) before the "
                               f"kernel returned: {waiting} committed, {len(open_group)} "
                               "uncommitted")

    EXIT_CHECKS.append(check_bulk_landed)

    def bulk_commit():
        commit_group("bulk")

    def fence_proxy_async_shared():
        pass

    def bulk_wait_read(pending):
        _bulk_land(pending)

    def bulk_wait(pending):
        _bulk_land(pending)
else:
    @intrinsic
    def st_shared_v4_f32(typingctx, smem, offset, x0, x1, x2, x3):
        """smem[offset:offset+4] = (x0, x1, x2, x3), one 16-byte shared store (offset a multiple of
        4)."""
        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            vals = [_as(context, builder, v, t, types.float32) for v, t in zip(args[2:], sig.args[2:])]
            _asm(builder, ir.VoidType(), [addr] + vals, "st.shared.v4.f32 [$0], {$1,$2,$3,$4};",
                 "r,f,f,f,f,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.void(smem, offset, x0, x1, x2, x3), codegen

    @intrinsic
    def bulk_reduce_add_f32(typingctx, dst, row, src, src_offset, nbytes):
        """The nbytes/4 floats of dst from (row, 0) on (dst contiguous: they may span rows) +=
        src[src_offset:src_offset+nbytes/4] (fp32, 16-byte aligned, nbytes a multiple of 16): one
        asynchronous bulk reduction by the copy engine, issued by the calling thread into its bulk
        group (cp.reduce.async.bulk...add.f32). Close the group with bulk_commit; the shared source
        may be overwritten after bulk_wait_read."""
        def codegen(context, builder, sig, args):
            gaddr = _global_address(context, builder, sig.args[0], args[0],
                                    [args[1], context.get_constant(types.int32, 0)],
                                    [sig.args[1], types.int32])
            saddr = _shared_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            n = _as(context, builder, args[4], sig.args[4], types.int32)
            _asm(builder, ir.VoidType(), [gaddr, saddr, n],
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
                 "l,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.void(dst, row, src, src_offset, nbytes), codegen

    @intrinsic
    def bulk_store(typingctx, address, src, src_offset, nbytes):
        """The nbytes at a 64-bit global address (global_address, moved by whole row pitches) =
        src[src_offset:...] (16-byte aligned at both ends, nbytes a multiple of 16): one
        asynchronous bulk copy from shared to global memory by the copy engine (no tensor map),
        issued by the calling thread into its bulk group. The source's ordinary stores need
        fence_proxy_async_shared and a barrier before; close the group with bulk_commit; the
        source may be overwritten after bulk_wait_read, and the copy is complete (before the
        kernel ends) after bulk_wait."""
        def codegen(context, builder, sig, args):
            gaddr = _as(context, builder, args[0], sig.args[0], types.int64)
            saddr = _shared_address(context, builder, sig.args[1], args[1], args[2], sig.args[2])
            n = _as(context, builder, args[3], sig.args[3], types.int32)
            _asm(builder, ir.VoidType(), [gaddr, saddr, n],
                 "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
                 "l,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.void(address, src, src_offset, nbytes), codegen

    bulk_commit = _make_statement("cp.async.bulk.commit_group;",
                                  "Close the calling thread's group of bulk operations issued since "
                                  "its last commit.")
    fence_proxy_async_shared = _make_statement(
        "fence.proxy.async.shared::cta;",
        "Order this thread's ordinary shared-memory writes before later reads of the same memory by "
        "the async proxy (the bulk copy engine); a barrier must still follow before the reader.")

    def _make_bulk_wait(read):
        suffix = ".read" if read else ""

        @intrinsic
        def bulk_wait(typingctx, pending):
            if not isinstance(pending, types.IntegerLiteral):
                return None
            n = pending.literal_value

            def codegen(context, builder, sig, args):
                _statement(builder, f"cp.async.bulk.wait_group{suffix} {n};")
                return context.get_dummy_value()

            return types.void(pending), codegen

        return bulk_wait

    bulk_wait_read = _make_bulk_wait(read=True)     # sources read: shared memory free to reuse
    bulk_wait = _make_bulk_wait(read=False)         # operations complete
