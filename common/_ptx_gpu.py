"""PTX instructions as Numba intrinsics (inline asm). Import through `common.ptx`, never directly.

Every function here has a pure-Python stand-in of the same name and meaning in
`common/_ptx_sim.py`; `common/ptx.py` picks one set. The docstrings of the stand-ins give the
lane-level semantics (which lane ends up holding which element); tests check each intrinsic on the
GPU against the stand-in's answer.

Conventions:
- Shared-memory operands are passed as (1-D shared array, element offset); the intrinsic turns them
  into a 32-bit shared address. Global operands as (2-D array, row, col).
- Instructions that touch memory are emitted `volatile` (LLVM side effects) so that they are never
  moved across a barrier or each other; pure arithmetic (mma, cvt, ex2) is left free to schedule.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cuda.extending import intrinsic

_f32 = ir.FloatType()
_i32 = ir.IntType(32)
_i64 = ir.IntType(64)


def _asm(builder, ret, operands, text, constraints, side_effect=False):
    """Emit one inline-asm statement; `ret` is an llvmlite type or a list of them (a struct)."""
    if isinstance(ret, list):
        ret = ir.LiteralStructType(ret)
    fnty = ir.FunctionType(ret, [op.type for op in operands])
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), operands)


def _unpack(builder, struct, n):
    return [builder.extract_value(struct, i) for i in range(n)]


def _as(context, builder, val, fromty, toty):
    return context.cast(builder, val, fromty, toty)


def _item_pointer(context, builder, aryty, aryval, indices, index_types):
    ary = context.make_array(aryty)(context, builder, aryval)
    idx = [_as(context, builder, i, t, types.intp) for i, t in zip(indices, index_types)]
    return cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)


def _shared_address(context, builder, aryty, aryval, offset, offset_type):
    """32-bit `.shared` address of element `offset` of a 1-D shared array: the array's base
    (converted once; loop-invariant) plus a 32-bit byte offset, so no 64-bit math per access."""
    ary = context.make_array(aryty)(context, builder, aryval)
    data = builder.addrspacecast(ary.data, ir.PointerType(ary.data.type.pointee, 3))
    base = builder.ptrtoint(data, _i32)
    itemsize = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
    off = _as(context, builder, offset, offset_type, types.int32)
    return builder.add(base, builder.mul(off, ir.Constant(_i32, itemsize)))


def _global_address(context, builder, aryty, aryval, indices, index_types):
    """64-bit `.global` address of an element of a global array."""
    ptr = _item_pointer(context, builder, aryty, aryval, indices, index_types)
    gptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 1))
    return builder.ptrtoint(gptr, _i64)


# --------------------------------------------------------------------------- tensor cores

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


mma_bf16_16816 = _make_mma("bf16")
mma_f16_16816 = _make_mma("f16")


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


ldmatrix_x4 = _make_ldmatrix(trans=False)
ldmatrix_x4_trans = _make_ldmatrix(trans=True)


# --------------------------------------------------------------------------- warp shuffles, math

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
def broadcast_u32(typingctx, x):
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        v = _as(context, builder, args[0], sig.args[0], types.uint32)
        return _asm(builder, _i32, [v], "shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r",
                    side_effect=True)   # warp-synchronous: kept where the converged warp calls it

    return sig, codegen


@intrinsic
def ex2_approx(typingctx, x):
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = _as(context, builder, args[0], sig.args[0], types.float32)
        return _asm(builder, _f32, [v], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

    return sig, codegen


@intrinsic
def rcp_approx(typingctx, x):
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = _as(context, builder, args[0], sig.args[0], types.float32)
        return _asm(builder, _f32, [v], "rcp.approx.ftz.f32 $0, $1;", "=f,f")

    return sig, codegen


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


pack_bf16x2 = _make_pack("bf16")
pack_f16x2 = _make_pack("f16")


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


unpack_bf16x2 = _make_unpack("bf16")
unpack_f16x2 = _make_unpack("f16")


def _statement(builder, text):
    """Emit an operand-less instruction that orders memory (a barrier, a copy-group fence)."""
    _asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)


def _make_statement(text, doc):
    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, sig, args):
            _statement(builder, text)
            return context.get_dummy_value()

        return types.void(), codegen

    statement.__doc__ = doc
    return statement


syncwarp = _make_statement("bar.warp.sync -1;", "All 32 lanes reach this point, and their "
                           "shared-memory writes before it are visible to the warp's reads after it.")


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
    """Count this thread's warp into named barrier `barrier` of `nthreads` threads without waiting
    (bar.arrive a, b): the threads that bar_sync on it wait for these arrivals too. Shared-memory
    writes before it are visible to the syncing threads after their bar_sync."""
    def codegen(context, builder, sig, args):
        ops = [_as(context, builder, v, t, types.int32) for v, t in zip(args, sig.args)]
        _asm(builder, ir.VoidType(), ops, "bar.arrive $0, $1;", "r,r,~{memory}", side_effect=True)
        return context.get_dummy_value()

    return types.void(barrier, nthreads), codegen


# --------------------------------------------------------------------------- asynchronous copies

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


# --------------------------------------------------------------------------- 16-byte accesses

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
    """Emit `text` with $0 = the 64-bit address of dst[row, col] (args[0:3]) and $1.. = the values
    args[3:] as `value_type`."""
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
def red_add_v2_f32(typingctx, dst, row, col, x0, x1):
    """dst[row, col:col+2] += (x0, x1), one vector reduction (sm_90; 8-byte aligned)."""
    def codegen(context, builder, sig, args):
        return _global_vector_op(context, builder, sig, args, types.float32,
                                 "red.global.add.v2.f32 [$0], {$1,$2};", "l,f,f,~{memory}")

    return types.void(dst, row, col, x0, x1), codegen


# --------------------------------------------------------------------------- bulk reductions (sm_90)

@intrinsic
def st_shared_v4_f32(typingctx, smem, offset, x0, x1, x2, x3):
    """smem[offset:offset+4] = (x0, x1, x2, x3), one 16-byte shared store (offset a multiple of 4)."""
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
