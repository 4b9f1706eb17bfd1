"""The host side of score_mod / mask_mod (common/tile/mods.py has the kernels' side): a call's
functions resolved to Numba device functions once, checked before any launch, and keyed.

    o, lse = variants.forward(q, k, v, variant="fa2", score_mod=alibi, mask_mod=document,
                              aux=(slopes, doc_ids))

`score_mod`, `mask_mod`, `score_mod_grad`: plain Python functions (compiled here with
`cuda.jit(device=True, inline="always")`), Numba device functions, or dotted names
("package.module.function", what a Hydra config names). `aux`: a tuple of device arrays of the
call's library (torch tensors, CuPy or Numba arrays) the functions receive as their last argument.

Keys: `ScoreMods` goes into the variant's Config (so `build`'s cache and the kernel cache see it).
Its repr names each function with a digest of its code (kernel_cache.function_digest), so a cubin
compiled from one version of a function is never loaded for another.
"""
import importlib
import inspect
from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from common.hardware.target import SIMULATOR
from common.host import arrays

ROLES = ("score_mod", "mask_mod", "score_mod_grad")
# the arguments each role is called with, before aux: (name, Numba type)
ARGUMENTS = {"score_mod": (("score", types.float32), ("b", types.int32), ("h", types.int32),
                           ("q_idx", types.int32), ("kv_idx", types.int32)),
             "mask_mod": (("b", types.int32), ("h", types.int32), ("q_idx", types.int32),
                          ("kv_idx", types.int32)),
             "score_mod_grad": (("grad", types.float32), ("score", types.float32),
                                ("b", types.int32), ("h", types.int32), ("q_idx", types.int32),
                                ("kv_idx", types.int32))}


@dataclass(frozen=True)
class ScoreMods:
    """A call's device functions (None where not given). Equal when the same functions are;
    its repr (part of every kernel-cache key) names each with its code's digest."""
    score_mod: object = None
    mask_mod: object = None
    score_mod_grad: object = None

    def __repr__(self):
        return "ScoreMods(" + ", ".join(f"{role}={name_of(fn)}:{_digest(fn)}"
                                        for role, fn in self.items()) + ")"

    def items(self):
        return [(role, getattr(self, role)) for role in ROLES if getattr(self, role) is not None]


_DIGESTS = {}


def _digest(fn):
    """The function's code digest (kernel_cache.function_digest); for one whose globals cannot
    be described, a token of this process alone, so that its kernels are never loaded by another."""
    hit = _DIGESTS.get(fn)
    if hit is None:
        from common.host.kernel_cache import function_digest
        try:
            hit = function_digest(fn)
        except TypeError:
            import uuid
            hit = "process-" + uuid.uuid4().hex
        _DIGESTS[fn] = hit
    return hit


def name_of(fn):
    fn = getattr(fn, "py_func", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_DEVICE = {}   # a user's Python function -> its device function (one kernel per function)


def device_function_of(fn, role):
    """fn (a Python function, a Numba device function, or a dotted name) as a device function."""
    if isinstance(fn, str):
        module, _, attr = fn.rpartition(".")
        if not module:
            raise ValueError(f"{role}={fn!r}: a dotted name is package.module.function")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{role}={fn!r} names no function: {e}") from None
    if hasattr(fn, "py_func"):   # already a Numba function: it must be a device function
        if not getattr(fn, "_can_compile", True) or getattr(fn, "targetoptions", {}).get(
                "device") is False:
            raise TypeError(f"{role} {name_of(fn)} is a kernel; pass a device function")
        return fn
    if not inspect.isfunction(fn):
        raise TypeError(f"{role} must be a function (or a dotted name of one), got "
                        f"{type(fn).__name__} {fn!r}")
    wanted = len(ARGUMENTS[role]) + 1
    count = len(inspect.signature(fn).parameters)
    if count != wanted:
        names = ", ".join(n for n, _ in ARGUMENTS[role])
        raise TypeError(f"{role} {name_of(fn)} takes {count} arguments; it is called as "
                        f"{role}({names}, aux)")
    dev = _DEVICE.get(fn)
    if dev is None:
        dev = _DEVICE[fn] = cuda.jit(device=True, inline="always")(fn)
    return dev


def resolve(score_mod=None, mask_mod=None, score_mod_grad=None):
    """The ScoreMods of a call, or None when it gives none."""
    given = dict(score_mod=score_mod, mask_mod=mask_mod, score_mod_grad=score_mod_grad)
    if all(fn is None for fn in given.values()):
        return None
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad without score_mod: there is no score_mod to differentiate")
    return ScoreMods(**{role: None if fn is None else device_function_of(fn, role)
                        for role, fn in given.items()})


def aux_views(library, aux):
    """The call's aux arrays as a tuple of kernel views, each of the inputs' `library` (any dtype
    and layout; each as Numba types it)."""
    if aux is None:
        return ()
    if not isinstance(aux, (tuple, list)):
        raise TypeError(f"aux must be a tuple of device arrays, got {type(aux).__name__}")
    views = []
    for i, x in enumerate(aux):
        d = arrays.describe(x, f"aux[{i}]")
        if d.library != library:
            raise TypeError(f"aux[{i}] is a {d.library} array but q is {library}")
        if d.dtype not in AUX_DTYPES:
            raise TypeError(f"aux[{i}] is {d.dtype}; aux arrays may be "
                            f"{', '.join(AUX_DTYPES)}")
        views.append(arrays.bits_view(d, np.dtype(d.dtype).type))
    return tuple(views)


AUX_DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
              "uint16", "uint32", "uint64", "bool")
_CHECKED = {}


def check(mods, aux, variant, backward=False):
    """Refuse, naming the function, before any launch: a backward of a score_mod without its
    score_mod_grad, and a function that does not type for its arguments or returns other than a
    number (score_mod, score_mod_grad) or a boolean (mask_mod). On the GPU the check types each
    function with Numba for (its scalars, aux's types) once; in the simulator it calls the Python
    function once on a zero score at index 0."""
    if backward and mods.score_mod is not None and mods.score_mod_grad is None:
        raise ValueError(f"{variant} backward with score_mod {name_of(mods.score_mod)} needs its "
                         f"derivative: pass score_mod_grad(grad, score, b, h, q_idx, kv_idx, aux) "
                         f"-> grad * d score_mod / d score (common.tile.mods.unchanged_grad for a "
                         f"bias added to the score)")
    aux_types = tuple(v.numba_type for v in aux)
    for role, fn in mods.items():
        key = (fn, role, aux_types)
        if key in _CHECKED:
            continue
        result = _typed_result(fn, role, aux, aux_types)
        if role == "mask_mod" and result != types.boolean:
            raise TypeError(f"{role} {name_of(fn)} returns {result}; it must return a boolean")
        if role != "mask_mod" and not isinstance(result, types.Number):
            raise TypeError(f"{role} {name_of(fn)} returns {result}; it must return a number")
        _CHECKED[key] = result


def _typed_result(fn, role, aux, aux_types):
    args = [t for _, t in ARGUMENTS[role]]
    if SIMULATOR:
        from numba.cuda.simulator.kernel import _push_kernel_context
        from numba.cuda.simulator.kernelapi import FakeCUDAModule, swapped_cuda_module
        values = [0.0 if t == types.float32 else 0 for t in args]   # (a grad of 0 adds nothing)
        fake = FakeCUDAModule((1, 1, 1), (1, 1, 1), 0)
        try:   # as the simulator runs device code: `cuda` in its globals the fake module
            with _push_kernel_context(fake), swapped_cuda_module(fn.py_func, fake):
                value = fn.py_func(*values, tuple(v.array for v in aux))
        except Exception as e:
            raise TypeError(f"{role} {name_of(fn)} fails on a score at index 0: "
                            f"{type(e).__name__}: {e}") from e
        if isinstance(value, (bool, np.bool_)):
            return types.boolean
        if isinstance(value, (int, float, np.number)):
            return types.float64
        return types.pyobject
    try:
        _, result = cuda.compile_ptx(fn.py_func, (*args, types.Tuple(aux_types)), device=True)
    except Exception as e:
        names = ", ".join(f"{n}: {t}" for n, t in ARGUMENTS[role])
        raise TypeError(f"{role} {name_of(fn)} does not compile for ({names}, aux: "
                        f"{types.Tuple(aux_types)}): {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return result


def with_mods(prob, score_mod=None, mask_mod=None, score_mod_grad=None, aux=None, variant="fa2",
              backward=False, block_mask=None):
    """prob with the call's mods resolved, checked and its aux viewed (prob.mods, prob.aux), in
    place. The forward's kernels do not use score_mod_grad: its ScoreMods leaves it out, so that
    a forward with and without it runs one kernel."""
    from dataclasses import replace
    mods = resolve(score_mod, mask_mod, score_mod_grad)
    if mods is None:
        if block_mask is not None:
            raise ValueError("block_mask without its mask_mod: pass mask_mod too")
        if aux:
            raise ValueError("aux without score_mod or mask_mod: nothing would read it")
        return prob
    if prob.is_fp8:
        raise ValueError(f"{variant}: score_mod and mask_mod take 16-bit inputs, not FP8")
    if mods.score_mod is not None and prob.softmax_scale == 0:
        raise ValueError("score_mod needs softmax_scale != 0 (the kernels hold raw scores and "
                         "divide the modified score by the scale)")
    views = aux_views(prob.library, aux)
    if not backward:
        mods = replace(mods, score_mod_grad=None)
    check(mods, views, variant, backward)
    prob.mods, prob.aux = mods, views
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a variants.block_mask(...), got "
                            f"{type(block_mask).__name__}")
        block_mask.check(prob, mods)
        prob.block_mask = block_mask
    return prob



class BlockMask:
    """A mask_mod's block structure for one geometry (FlexAttention's BlockMask): which key
    blocks each query block of a kernel meets, listed on the GPU the first time a kernel with
    those block sizes asks (`lists`) and kept, so that one BlockMask serves every call and layer
    of that geometry. `batch` and `heads` are those the mask varies over: 1 where it is the same
    for every batch or head (a document mask: batch=1, heads=1, one list for all). The lists read
    `aux` when they are made: a BlockMask is for the contents aux had then."""

    def __init__(self, mask_mod, n_q, n_k, batch=1, heads=1, aux=(), like=None):
        self.mask_mod = device_function_of(mask_mod, "mask_mod")
        for name, n in (("n_q", n_q), ("n_k", n_k), ("batch", batch), ("heads", heads)):
            if not isinstance(n, (int, np.integer)) or n < (0 if name.startswith("n_") else 1):
                kind = "count" if name.startswith("n_") else "positive count"
                raise ValueError(f"block_mask: {name} must be a {kind}, got {n!r}")
        self.n_q, self.n_k, self.batch, self.heads = int(n_q), int(n_k), int(batch), int(heads)
        self.aux = tuple(aux)
        self.like = like if like is not None else (self.aux[0] if self.aux else None)
        if self.like is None:
            raise ValueError("block_mask needs `like` (an array of the inputs' library and device) "
                             "when it has no aux")
        self.library = arrays.describe(self.like, "like").library
        self._lists = {}

    def check(self, prob, mods):
        """Refuse a call whose mask_mod or geometry is not this BlockMask's."""
        if mods is None or mods.mask_mod is not self.mask_mod:
            theirs = name_of(mods.mask_mod) if mods and mods.mask_mod else None
            raise ValueError(f"block_mask was made for mask_mod {name_of(self.mask_mod)}; the "
                             f"call's is {theirs}")
        if prob.varlen is not None:
            raise ValueError("block_mask with a packed batch (varlen): not built yet")
        if (self.n_q, self.n_k) != (prob.n_q, prob.n_k) or self.batch not in (1, prob.batch) or \
                self.heads not in (1, prob.heads):
            raise ValueError(f"block_mask is for N_q={self.n_q}, N_k={self.n_k}, batch "
                             f"{self.batch}, heads {self.heads}; the call has N_q={prob.n_q}, "
                             f"N_k={prob.n_k}, batch {prob.batch}, heads {prob.heads}")

    def lists(self, block_m, block_n, stream=0, transposed=False):
        """(blocks, counts) kernel views for query blocks of block_m rows and key blocks of
        block_n keys: blocks (batch, heads, N_q / block_m, N_k / block_n) int32 entries (common/
        tile/mods.py FULL), counts (batch, heads, N_q / block_m) int32; transposed: the lists of
        the key blocks, (batch, heads, N_k / block_n, N_q / block_m); made once."""
        hit = self._lists.get((block_m, block_n, transposed))
        if hit is None:
            from common.host.launching import launch
            from common.tile.mods import block_lister
            n_qb, n_kb = -(-self.n_q // block_m), -(-self.n_k // block_n)
            own, other = (n_kb, n_qb) if transposed else (n_qb, n_kb)
            blocks = arrays.zeros(self.library, (self.batch, self.heads, max(own, 1),
                                                 max(other, 1)), "int32", like=self.like)
            counts = arrays.zeros(self.library, (self.batch, self.heads, max(own, 1)), "int32",
                                  like=self.like)
            views = tuple(arrays.bits_view(arrays.describe(x), np.int32) for x in (blocks, counts))
            aux = aux_views(self.library, self.aux)
            check(ScoreMods(mask_mod=self.mask_mod), aux, "block_mask")
            if n_qb and n_kb:
                launch(block_lister(self.mask_mod, block_m, block_n, 128, transposed),
                       (own, self.batch * self.heads), 128, 0, stream, *views,
                       np.int32(self.n_q), np.int32(self.n_k), np.int32(self.heads), aux)
            hit = self._lists[(block_m, block_n, transposed)] = (views, (blocks, counts))
        return hit[0]

    def blocks_kept(self, block_m, block_n, transposed=False):
        """Host (counts, blocks) of `lists` (tests, statistics)."""
        self.lists(block_m, block_n, transposed=transposed)
        blocks, counts = self._lists[(block_m, block_n, transposed)][1]
        return arrays.to_host(counts), arrays.to_host(blocks)

    def args(self, block_m, block_n, stream=0, transposed=False):
        """A kernel's block-mask arguments: lists, counts, and whether they vary by batch and
        head (0: one list for all)."""
        blocks, counts = self.lists(block_m, block_n, stream, transposed)
        return blocks, counts, np.int32(self.batch > 1), np.int32(self.heads > 1)


def no_block_mask(prob):
    """Block-mask arguments of a kernel without one: one empty list (never read)."""
    return (arrays.placeholder(prob.library, 4, prob.like, "int32"),
            arrays.placeholder(prob.library, 3, prob.like, "int32"), np.int32(0), np.int32(0))
