"""The element types the kernels compute with, as compile-time descriptions (issue 15).

One `Element` says what differs between them: the bits of one value, the K of one tensor-core
step (32 bytes of a row: k16 for the 16-bit types, k32 for e4m3), the PTX type its mma / wgmma
and cvt name, and the small int `code` a kernel closes over. Numba device functions cannot take a
dataclass, so kernels pass `elem = cfg.element.code` down the tile layer; it is a compile-time
constant, so `if elem == BF16` in the few helpers that differ per type (the mma opcode, packing a
pair, the epilogue's cvt) is folded away and every other helper only passes it along. A new
element type is one more value here and one more branch in those helpers.
"""
from dataclasses import dataclass

# The codes device helpers compare with (module constants: folded where they are read).
F16, BF16, E4M3 = 0, 1, 2


@dataclass(frozen=True)
class Element:
    name: str       # as numpy / torch / ml_dtypes spell it
    code: int       # the compile-time constant the kernels pass down (F16, BF16, E4M3)
    bits: int
    k_step: int     # the K of one mma.sync / wgmma: 32 bytes of A's and B's rows
    ptx: str        # the type in mma / wgmma / cvt ("f16", "bf16", "e4m3")
    tag: str        # the short name in kernel and report names ("fp16", "bf16", "e4m3")

    @property
    def bytes(self):
        return self.bits // 8

    def __hash__(self):   # the codes are distinct: hash one int, not six fields (configs and
        return self.code  # kernel builders are looked up by it on every call)

    def __repr__(self):
        return self.name


FLOAT16 = Element("float16", F16, 16, 16, "f16", "fp16")
BFLOAT16 = Element("bfloat16", BF16, 16, 16, "bf16", "bf16")
E4M3_FN = Element("float8_e4m3fn", E4M3, 8, 32, "e4m3", "e4m3")
ELEMENTS = {e.name: e for e in (FLOAT16, BFLOAT16, E4M3_FN)}
# u, the relative rounding error of a normal value of each type (half its epsilon)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -4}


def element(x):
    """The Element of a name (numpy / torch dtype spelling, or a dtype) or an Element itself."""
    if isinstance(x, Element):
        return x
    name = str(x).removeprefix("torch.")
    if name not in ELEMENTS:
        raise ValueError(f"element type {name!r}: one of {', '.join(ELEMENTS)}")
    return ELEMENTS[name]
