"""The compiled-kernel cache: cubins kept on disk, keyed by everything they are compiled from.

A configuration's kernels take 10-80 s to compile (Numba typing, NVVM on fully unrolled loops,
the linker's ptxas), so without a cache every new process (a notebook restart, each job of a
sweep, each rank of a torchrun) pays that again. `launch` (common/host/launching.py) asks
`load_or_compile` for each kernel once per argument types and process; it loads the cubin from
the cache when one is kept for the kernel's key, else compiles it and keeps it. In Numba's CUDA
simulator nothing is compiled and the cache is never read or written.

Where (`cache_dir`): the cache is on by default.
- FA_KERNEL_CACHE=<dir>: that directory (created when missing);
- FA_KERNEL_CACHE set to 0, off, false (any case) or the empty string: off (experiments/probes set
  it to "" so that their stamped kernels never meet the real ones' cubins);
- unset: $XDG_CACHE_HOME/flash-numba (an absolute XDG_CACHE_HOME), else ~/.cache/flash-numba.
A directory that cannot be created leaves the process without a cache, and one that cannot be
written serves the cubins it holds and keeps no new ones; either way one KernelCacheWarning says
so (once a process) and the call goes on, compiling.

What (`store`, `load`): a kernel is two files, <key>.cubin and <key>.entry (its entry name), each
written to a temporary file whose name is unique to the process and thread and renamed into place
(atomic), cubin first: an .entry file means a complete pair, and processes storing one key at once
(the same bytes) leave one whole pair. A load touches the .entry file's mtime: its recency.

Bounded (`evict`): FA_KERNEL_CACHE_MAX_MB (MiB, default 2048; `inf`: no bound). After each store
the least recently used pairs (a pair's recency: the newer of its two files' mtimes) are removed,
the two files together, until the directory's entries fit; temporary files a crashed writer left
(over an hour old) go too. Stores follow compiles (seconds), so the directory scan costs nothing
that counts; a load does no scan.

The key (`cache_key`) covers everything a cubin depends on: the source of every module of the
device layers, common/hardware/ and common/tile/ (any edit to one invalidates every entry;
common/host/, this layer, holds no device code and is left out) and of each variants/ module the
kernel or a device function it calls is defined in (an edit to fa2.py leaves fa1's and standard's
kernels cached; kernel bodies reach other variants only through closures, which closure_constants
walks), the kernel's name and the compile-time constants its closure holds (recursively through
its device functions), the argument types (an array's dtype, rank and layout: C or A), the jit
options (launch bounds, opt, debug, lto), the GPU's compute capability, and the toolchain
(`toolchain_version`: numba-cuda's and numba's versions, those of cuda-core, cuda-bindings and the
NVVM and nvJitLink wheels, NVVM's own version and IR version with its library's size, and the
linker that makes the cubin: nvJitLink's version and library size, or the driver's version when
the driver links). A part it cannot find reads "?", so a key is always made.

`python -m variants.precompile` fills the cache with the common configurations in parallel
processes, and with --info / --clear shows or empties it (docs/compile_cache.md).
"""
import hashlib
import os
import pathlib
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]   # the repository (two above)


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
    if not _is_own(fn):   # a user's function (score_mod, mask_mod): its code is not in our source
        parts.append(f"code={function_digest(fn)}")
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        parts.append(f"{name}={_describe(cell.cell_contents, _seen)}")
    return "(" + ",".join(parts) + ")"


OWN_PACKAGES = ("variants", "common")   # whose source source_digest covers


def _is_own(fn):
    return (getattr(fn, "__module__", None) or "").split(".")[0] in OWN_PACKAGES


def function_digest(fn, _seen=None):
    """sha256 (16 hex digits) of a function that is not this package's (a user's score_mod): its
    code object (bytecode, constants, nested functions, names) and the globals it names: numbers
    and tuples by value, modules by name, functions by their own digest (this package's by name:
    source_digest covers them). TypeError for a global it cannot describe (the kernel is then
    compiled, never cached)."""
    import marshal
    fn = getattr(fn, "py_func", fn)
    _seen = set() if _seen is None else _seen
    if id(fn) in _seen:
        return "<seen>"
    _seen.add(id(fn))
    code = fn.__code__
    h = hashlib.sha256(marshal.dumps(code))
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(x for x in c.co_consts if hasattr(x, "co_names"))
    for name in sorted(names):
        if name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        if type(value).__name__ == "module":
            part = f"module {value.__name__}"
        elif callable(getattr(value, "py_func", None)) or hasattr(value, "__code__"):
            inner = getattr(value, "py_func", value)
            part = f"{inner.__module__}.{inner.__qualname__}" if _is_own(inner) else \
                function_digest(inner, _seen)
        else:
            part = _describe(value, _seen)
        h.update(f"{name}={part}\0".encode())
    return h.hexdigest()[:16]


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
    constants = closure_constants(kern)
    # the jit options (launch bounds: what ptxas may spend on registers) shape the cubin too
    options = repr(sorted(getattr(kern, "targetoptions", {}).items()))
    text = "|".join([source_digest(source_modules(kern, constants)), constants, repr(sig),
                     repr(cc), toolchain_version(), options])
    name = kern.py_func.__name__
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


# --------------------------------------------------------------------------- the toolchain

TOOLCHAIN_DISTRIBUTIONS = ("numba-cuda", "numba", "cuda-core", "cuda-bindings", "nvidia-nvvm",
                           "nvidia-nvjitlink")


@lru_cache(maxsize=None)
def toolchain_version():
    """What turns a kernel's Python into a cubin, as one string for the key: the versions of the
    TOOLCHAIN_DISTRIBUTIONS ("-": not installed as a wheel, e.g. a system CUDA), NVVM's own version
    and IR version and its library's size (NVVM reports only "2.0"), and the linker that runs
    ptxas (nvJitLink's version and library size, or the driver's version). Needs no GPU; a part it
    cannot find reads "?"."""
    from importlib import metadata

    def dist(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"
    parts = [f"{name}={dist(name)}" for name in TOOLCHAIN_DISTRIBUTIONS]
    parts += [f"nvvm={_attempt(_nvvm_version)}", f"linker={_attempt(_linker_version)}"]
    return ";".join(parts)


def _attempt(part):
    try:
        return part()
    except Exception:   # a library missing or refusing (no driver here): the key is still made
        return "?"


def _nvvm_version():
    from numba.cuda.cudadrv import nvvm
    library = nvvm.NVVM()
    path = nvvm.get_cuda_paths()["nvvm"].info
    return f"{library.get_version()}/{library.get_ir_version()}/{_file_size(path)}"


def _linker_version():
    try:   # cuda.core's Linker (numba-cuda's) links with nvJitLink when it loads, else the driver
        from cuda.core._linker import _decide_nvjitlink_or_driver
        by_driver = _decide_nvjitlink_or_driver()
    except Exception:
        from numba.cuda.cudadrv.driver import _have_nvjitlink
        by_driver = not _have_nvjitlink()
    if by_driver:
        from cuda.bindings import driver
        err, version = driver.cuDriverGetVersion()
        return f"driver {version if int(err) == 0 else '?'}"
    import cuda.pathfinder
    from cuda.bindings import nvjitlink
    path = cuda.pathfinder.load_nvidia_dynamic_lib("nvJitLink").abs_path
    return f"nvjitlink {nvjitlink.version()}/{_file_size(path)}"


def _file_size(path):
    return f"{os.path.basename(path)}:{os.path.getsize(path)}"


# --------------------------------------------------------------------------- where, and whether

ENV, MAX_ENV = "FA_KERNEL_CACHE", "FA_KERNEL_CACHE_MAX_MB"
OFF_VALUES = ("", "0", "off", "false")   # FA_KERNEL_CACHE's values that turn the cache off
DEFAULT_MAX_MB = 2048
MB = 1 << 20
SUFFIXES = (".cubin", ".entry")
STALE_TMP_SECONDS = 3600   # a temporary file this old is a crashed writer's


class KernelCacheWarning(UserWarning):
    """The kernel cache cannot be used as configured (a directory that cannot be created or
    written, a size bound that is not a number): the call goes on, compiling."""


def cache_dir():
    """The cache's directory as the environment configures it (not created), or None when
    FA_KERNEL_CACHE turns caching off: FA_KERNEL_CACHE, else $XDG_CACHE_HOME/flash-numba (an
    absolute XDG_CACHE_HOME), else ~/.cache/flash-numba."""
    value = os.environ.get(ENV)
    if value is not None:
        if value.strip().lower() in OFF_VALUES:
            return None
        return pathlib.Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return pathlib.Path(xdg) / "flash-numba"
    try:
        return pathlib.Path.home() / ".cache" / "flash-numba"
    except (RuntimeError, KeyError):   # no HOME and no password entry: nowhere to keep it
        return None


_lock = threading.Lock()
_modes = {}     # directory -> "rw", "ro" (loads only) or None (unusable): probed once a process
_warned = set()


def usable_dir():
    """(directory, writable) for this process: the configured directory, created and probed for
    writing on first use (once a process); (None, False) when the cache is off or the directory
    cannot be created; writable False when it can be read but not written (loads only). Each
    failure warns once (KernelCacheWarning)."""
    directory = cache_dir()
    if directory is None:
        return None, False
    problem = None
    with _lock:
        if directory not in _modes:
            _modes[directory], problem = _probe(directory)
        mode = _modes[directory]
    if problem is not None:   # warned once the mode is kept: a warning raised (pytest's
        _warn(directory, *problem)   # filterwarnings=error) leaves the next call without a cache
    return (directory if mode else None), mode == "rw"


def _probe(directory):
    """(mode, None) or (mode, (what failed, its consequence))."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, (f"cannot create it ({e.strerror or e})", "kernels are compiled, not kept")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
        return "rw", None
    except OSError as e:
        readable = directory.is_dir() and os.access(directory, os.R_OK | os.X_OK)
        return ("ro" if readable else None), (
            f"cannot write there ({e.strerror or e})",
            "the kernels it holds are loaded, new ones compiled and not kept" if readable
            else "kernels are compiled, not kept")


def _warn(directory, what, consequence):
    if not _first_time((directory, what)):
        return
    warnings.warn(f"kernel cache {directory}: {what}; {consequence}. Set {ENV} to a writable "
                  f"directory, or {ENV}=off to turn the cache off.", KernelCacheWarning,
                  stacklevel=3)


def _first_time(what):
    with _lock:
        seen = what in _warned
        _warned.add(what)
    return not seen


def max_bytes():
    """The size bound in bytes: FA_KERNEL_CACHE_MAX_MB MiB (a positive number, `inf` for none),
    DEFAULT_MAX_MB when unset; anything else warns once and uses the default."""
    value = os.environ.get(MAX_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_MB * MB
    try:
        mb = float(value)
    except ValueError:
        mb = float("nan")
    if not mb > 0:
        if _first_time(("max", value)):
            warnings.warn(f"{MAX_ENV}={value!r} is not a positive number of MiB: the kernel cache "
                          f"is held to {DEFAULT_MAX_MB}", KernelCacheWarning, stacklevel=2)
        return DEFAULT_MAX_MB * MB
    return mb * MB


# --------------------------------------------------------------------------- the files

@dataclass(frozen=True)
class Entry:
    """One key's files in the cache: its cubin and entry file (complete), or either alone."""
    key: str
    paths: tuple
    bytes: int
    last_used: float     # the newer of its files' mtimes (a load touches the entry file)

    @property
    def complete(self):
        return {os.path.splitext(p)[1] for p in self.paths} == set(SUFFIXES)


def entries(directory):
    """The cache's entries in `directory`, least recently used first ([] when it is missing)."""
    groups = {}
    try:
        scan = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    with scan:
        for f in scan:
            key, suffix = os.path.splitext(f.name)
            if suffix not in SUFFIXES or not f.is_file(follow_symlinks=False):
                continue
            try:
                st = f.stat()
            except FileNotFoundError:   # removed meanwhile, by another process's eviction
                continue
            groups.setdefault(key, []).append((f.path, st.st_size, st.st_mtime))
    found = [Entry(key, tuple(sorted(p for p, _, _ in files)), sum(s for _, s, _ in files),
                   max(t for _, _, t in files)) for key, files in groups.items()]
    return sorted(found, key=lambda e: (e.last_used, e.key))


def load(directory, key):
    """(cubin bytes, entry name) kept under `key`, or None; touches the entry file (recency)."""
    entry = pathlib.Path(directory) / f"{key}.entry"
    try:
        name = entry.read_text()
        cubin = (pathlib.Path(directory) / f"{key}.cubin").read_bytes()
    except OSError:   # not kept, or evicted between the two reads
        return None
    if not name or not cubin:
        return None
    try:
        os.utime(entry)
    except OSError:   # a cache we may only read
        pass
    return cubin, name


def store(directory, key, cubin, entry_name, limit=None):
    """Keep `cubin` (bytes) and its entry name under `key`: each file written to a temporary name
    unique to this process and thread and renamed into place, cubin first; then hold the
    directory to `limit` bytes (max_bytes()) by `evict`, never removing this key. Returns False
    (with one KernelCacheWarning a process, the directory then used for loads only) when it cannot
    write."""
    directory = pathlib.Path(directory)
    tmp = directory / f"{key}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        tmp.write_bytes(cubin)
        os.replace(tmp, directory / f"{key}.cubin")   # cubin first: an entry means a whole pair
        tmp.write_text(entry_name)
        os.replace(tmp, directory / f"{key}.entry")
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        with _lock:
            if _modes.get(directory) == "rw":
                _modes[directory] = "ro"
        _warn(directory, f"cannot store a kernel ({e.strerror or e})", "new ones are not kept")
        return False
    evict(directory, max_bytes() if limit is None else limit, keep=(key,))
    return True


def evict(directory, limit, keep=()):
    """Remove the least recently used entries (both files of a key together) until those left
    take at most `limit` bytes, never a key in `keep`, and temporary files over
    STALE_TMP_SECONDS old. Returns the entries removed."""
    directory = pathlib.Path(directory)
    now = time.time()
    for tmp in directory.glob("*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                tmp.unlink()
        except OSError:
            pass
    found = entries(directory)
    total = sum(e.bytes for e in found)
    removed = []
    for e in found:
        if total <= limit:
            break
        if e.key in keep:
            continue
        _remove(e)
        total -= e.bytes
        removed.append(e)
    return removed


def _remove(entry):
    for path in sorted(entry.paths, key=lambda p: not p.endswith(".entry")):   # the entry first
        try:
            os.unlink(path)
        except OSError:   # gone already (another process's eviction), or not ours to remove
            pass


def info(directory=None):
    """{"path", "entries" (complete pairs), "bytes" (all the cache's files), "limit"} of the cache
    (the configured one by default); path None when the cache is off."""
    directory = cache_dir() if directory is None else pathlib.Path(directory)
    found = entries(directory) if directory is not None else []
    return {"path": directory, "entries": sum(e.complete for e in found),
            "bytes": sum(e.bytes for e in found), "limit": max_bytes()}


def clear(directory=None):
    """Remove every cache file (<key>.cubin, <key>.entry, temporary files) from the cache's
    directory, nothing else in it; returns (entries, bytes) removed."""
    directory = cache_dir() if directory is None else pathlib.Path(directory)
    if directory is None:
        return 0, 0
    found = entries(directory)
    for e in found:
        _remove(e)
    for tmp in directory.glob("*.tmp"):
        try:
            tmp.unlink()
        except OSError:
            pass
    return sum(e.complete for e in found), sum(e.bytes for e in found)


# --------------------------------------------------------------------------- the launch's path

def load_or_compile(kern, sig):
    """The kernel's CUfunction: loaded from the cache when it keeps this kernel's key, else
    compiled (and stored when the cache is on and writable). Runs on a GPU only (`launch` calls
    it once per kernel and argument types a process)."""
    directory, writable = usable_dir()
    if directory is None:
        return compile_function(kern, sig)
    try:
        key = cache_key(kern, sig, device_compute_capability())
    except TypeError:   # a closure constant the key cannot describe: never cached
        return compile_function(kern, sig)
    found = load(directory, key)
    if found is not None:
        try:
            return module_function(*found)
        except Exception:   # a damaged cubin: compiled again below, and stored over it
            pass
    library = kern.compile(sig)._codelibrary
    cufunc = library.get_cufunc()
    if writable:
        # the cubin get_cufunc loaded: built for the device's arch, sm_90a on Hopper (numba-cuda
        # 0.30 adds the "a"; asking for cc (9, 0) would compile again, for sm_90, which rejects
        # wgmma); numba-cuda 0.30's get_cubin gives a cuda.core ObjectCode
        image = library.get_cubin()
        store(directory, key, getattr(image, "code", image), library._entry_name)
    return cufunc


def compile_function(kern, sig):
    """Compile (Numba, NVVM, the linker) and load: the kernel's CUfunction."""
    return kern.compile(sig)._codelibrary.get_cufunc()


def device_compute_capability():
    return cuda.current_context().device.compute_capability


def module_function(cubin, entry_name):
    """The CUfunction `entry_name` of a cubin, loaded into the current context."""
    from cuda.core import ObjectCode
    module = cuda.current_context().create_module_image(ObjectCode.from_cubin(cubin), [], [])
    return module.get_function(entry_name)
