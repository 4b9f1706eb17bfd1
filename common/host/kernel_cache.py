"""The compiled-kernel cache: cubins kept on disk, keyed by everything they are compiled from.

A configuration's kernels take 10-80 s to compile (Numba typing, NVVM on fully unrolled loops,
ptxas), so a benchmark sweep or a GPU test run on a fresh machine spends most of its time
compiling. With FA_KERNEL_CACHE=<dir>, `launch` keeps each kernel's cubin there and later
processes load it instead of compiling. The key covers everything a cubin depends on: the source
of every module of the device layers, common/hardware/ and common/tile/ (any edit to one
invalidates every entry; common/host/, this layer, holds no device code and is left out) and of
each variants/ module
the kernel or a device function it calls is defined in (an edit to fa2.py leaves fa1's and
standard's kernels cached; kernel bodies reach other variants only through closures, which
closure_constants walks), the kernel's name and the compile-time constants its closure holds
(recursively through its device functions), the argument types, the jit options (launch bounds),
the GPU's compute capability and numba-cuda's version.
"""
import hashlib
import os
import pathlib
import re
from functools import lru_cache

from numba import cuda

_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent


# The layers whose source a cubin can depend on. common/host/ (argument checks, array adapters,
# configuration lookup, launching, the KV cache's host side, TMA tensor maps, this cache) holds no
# device code: an edit to it keeps the cache. tests/test_compile.py checks that no compile
# target's code reaches it (functions, modules, or values imported from it).
DEVICE_LAYERS = ("common/hardware", "common/tile")
HOST_PACKAGE = "common.host"


@lru_cache(maxsize=None)
def source_digest(modules=()):
    """sha256 over the source of the device layers (DEVICE_LAYERS) and of the given
    `variants.<name>` modules."""
    h = hashlib.sha256()
    paths = sorted(p for layer in DEVICE_LAYERS for p in (_PACKAGE_ROOT / layer).glob("*.py")) + [
        _PACKAGE_ROOT / "variants" / f"{m.split('.')[1]}.py" for m in sorted(modules)]
    for path in paths:
        h.update(str(path.relative_to(_PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def closure_constants(fn, _seen=None):
    """The compile-time constants a kernel or device function closes over, as a string: numbers,
    strings, tuples, dataclass configs, and (recursively) the closures of the functions it calls.
    Raises TypeError for a cell it cannot describe exactly, so that such a kernel is never cached
    under a key that ignores part of what it was compiled from."""
    fn = getattr(fn, "py_func", fn)
    _seen = set() if _seen is None else _seen
    if id(fn) in _seen:
        return "<seen>"
    _seen.add(id(fn))
    parts = [f"{fn.__module__}.{fn.__qualname__}"]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        parts.append(f"{name}={_describe(cell.cell_contents, _seen)}")
    return "(" + ",".join(parts) + ")"


def _describe(value, seen):
    import dataclasses

    import numpy as np
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ",".join(_describe(v, seen) for v in value) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    if callable(getattr(value, "py_func", None)) or hasattr(value, "__code__"):
        return closure_constants(value, seen)
    if type(value).__name__ == "_Intrinsic":
        return f"intrinsic:{getattr(value, 'cache_name', value._name)}"   # sm90.py names each
    if type(value).__module__ == "numba.core.types.abstract" or hasattr(value, "bitwidth"):
        return repr(value)   # a Numba type (e.g. a dtype closed over as a constant)
    raise TypeError(f"cannot describe closure constant {value!r} of type {type(value).__name__}")


def source_modules(kern, constants=None):
    """The variants modules whose source a kernel is compiled from: its own and those of the
    device functions in its closure (named in closure_constants' description)."""
    constants = closure_constants(kern) if constants is None else constants
    modules = {kern.py_func.__module__} | set(re.findall(r"\((variants\.\w+)\.", constants))
    return tuple(sorted(m for m in modules if m.startswith("variants.")))


def cache_key(kern, sig, cc):
    """The file name a kernel's cubin is kept under."""
    from numba import cuda as _cuda
    version = getattr(_cuda, "__version__", "")
    constants = closure_constants(kern)
    # the jit options (launch bounds: what ptxas may spend on registers) shape the cubin too
    options = repr(sorted(getattr(kern, "targetoptions", {}).items()))
    text = "|".join([source_digest(source_modules(kern, constants)), constants, repr(sig),
                     repr(cc), version, options])
    name = kern.py_func.__name__
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def cache_dir():
    """FA_KERNEL_CACHE as a directory (created), or None when caching is off."""
    path = os.environ.get("FA_KERNEL_CACHE")
    if not path:
        return None
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_or_compile(kern, sig):
    """The kernel's CUfunction: from FA_KERNEL_CACHE when it holds this kernel, else compiled
    (and stored there when caching is on)."""
    directory = cache_dir()
    if directory is None:
        return kern.compile(sig)._codelibrary.get_cufunc()
    ctx = cuda.current_context()
    cc = ctx.device.compute_capability
    try:
        key = cache_key(kern, sig, cc)
    except TypeError:
        return kern.compile(sig)._codelibrary.get_cufunc()
    cubin, entry = directory / f"{key}.cubin", directory / f"{key}.entry"
    if cubin.exists() and entry.exists():
        from cuda.core import ObjectCode
        module = ctx.create_module_image(ObjectCode.from_cubin(cubin.read_bytes()), [], [])
        return module.get_function(entry.read_text())
    library = kern.compile(sig)._codelibrary
    cufunc = library.get_cufunc()
    # the cubin get_cufunc loaded: built for the device's arch, sm_90a on Hopper (numba-cuda 0.30
    # adds the "a"; asking for cc (9, 0) would compile again, for sm_90, which rejects wgmma)
    image = library.get_cubin()                    # numba-cuda 0.30: a cuda.core ObjectCode
    tmp = directory / f"{key}.{os.getpid()}.tmp"
    tmp.write_bytes(getattr(image, "code", image))
    os.replace(tmp, cubin)        # cubin first: an entry file means a complete pair
    tmp.write_text(library._entry_name)
    os.replace(tmp, entry)
    return cufunc
