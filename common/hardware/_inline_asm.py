"""Inline-PTX code generation for Numba intrinsics: the low-level helpers that the GPU side of
common/hardware/sm80.py and common/hardware/sm90.py is written with (llvmlite types, one inline-asm statement,
argument casts, 32-bit shared and 64-bit global addresses of array elements, operand-less
statements). GPU only: nothing here runs in the simulator.

Conventions of the instructions built with them:
- Shared-memory operands are passed as (1-D shared array, element offset); the intrinsic turns them
  into a 32-bit shared address. Global operands as (2-D array, row, col).
- Instructions that touch memory are emitted `volatile` (LLVM side effects) so that they are never
  moved across a barrier or each other; pure arithmetic (mma, cvt, ex2) is left free to schedule.

The names keep their leading underscore: they are the instruction modules' codegen internals,
never called from a kernel.
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


# --------------------------------------------------------------------------- operand-less statements

def _statement(builder, text):
    """Emit an operand-less instruction that orders memory (a barrier, a copy-group fence)."""
    _asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)


def _make_statement(text, doc=None):
    """An intrinsic of no arguments that emits `text` as _statement does (documented by `doc`)."""
    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, sig, args):
            _statement(builder, text)
            return context.get_dummy_value()

        return types.void(), codegen

    statement.__doc__ = doc
    return statement
