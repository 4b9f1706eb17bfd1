"""`launch`: the per-call path to cuLaunchKernel (kernel views, packed parameter words, the
launch record a replay re-issues). Compiled kernels are kept by common/host/kernel_cache.py."""
import threading
from contextlib import contextmanager

from numba import cuda

from common.hardware.target import SIMULATOR


class ViewLayout:
    """The geometry of a kernel view, made once per (shape, byte strides, element dtype) and shared
    by every view of that geometry: what Numba types the array as (C layout when C-contiguous, else
    any, "A") and its words in Numba's kernel ABI but the data pointer (an array is meminfo, parent,
    size, itemsize, data, shape..., strides...)."""
    __slots__ = ("shape", "strides", "dtype", "numba_type", "head", "tail")

    def __init__(self, shape, strides, dtype, numba_type):
        self.shape, self.strides, self.dtype, self.numba_type = shape, strides, dtype, numba_type
        size = 1
        for n in shape:
            size *= n
        self.head, self.tail = (0, 0, size, dtype.itemsize), (*shape, *strides)


_ARRAY_TYPES = {}
_LAYOUTS = {}          # (shape, strides, dtype) -> ViewLayout


def view_layout(shape, strides, dtype):
    """The ViewLayout of a geometry (shape and strides tuples, a NumPy dtype), built once: typing a
    view costs ~5 us and a call's views repeat the last call's geometry."""
    key = (shape, strides, dtype)
    hit = _LAYOUTS.get(key)
    if hit is None:
        from numba import from_dtype, types
        expect, contiguous = dtype.itemsize, True
        for n, stride in zip(reversed(shape), reversed(strides)):
            contiguous &= n == 1 or stride == expect
            expect *= n
        tkey = (dtype, len(shape), "C" if contiguous else "A")
        numba_type = _ARRAY_TYPES.get(tkey)
        if numba_type is None:   # building a Numba type costs ~10 us: once per kind of view
            numba_type = _ARRAY_TYPES[tkey] = types.Array(from_dtype(dtype), len(shape), tkey[2])
        if len(_LAYOUTS) >= 4096:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = ViewLayout(tuple(shape), tuple(strides), dtype, numba_type)
    return hit


class KernelView:
    """A device array as a kernel argument: an address and a ViewLayout (shape, byte strides and
    element type, any axis order) over someone else's memory (`owner` keeps it alive). `launch`
    passes its words straight to the driver; `.array` is the same memory as a Numba device array
    (or, in the simulator, a simulator array)."""
    __slots__ = ("ptr", "layout", "owner", "_array")

    def __init__(self, ptr, shape, strides, dtype, owner, array=None):
        self.ptr, self.layout = ptr, view_layout(tuple(shape), tuple(strides), dtype)
        self.owner, self._array = owner, array

    @classmethod
    def over(cls, ptr, layout, owner):
        """A view of a known layout (the per-call path: no geometry to look up)."""
        view = cls.__new__(cls)
        view.ptr, view.layout, view.owner, view._array = ptr, layout, owner, None
        return view

    shape = property(lambda self: self.layout.shape)
    strides = property(lambda self: self.layout.strides)
    dtype = property(lambda self: self.layout.dtype)
    numba_type = property(lambda self: self.layout.numba_type,
                          doc="What Numba would type the array as (ViewLayout).")

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "data": (self.ptr, False),
                "typestr": self.dtype.str, "version": 3}

    @property
    def array(self):
        if self._array is None:
            self._array = cuda.from_cuda_array_interface(self.__cuda_array_interface__,
                                                         owner=self.owner, sync=False)
        return self._array


_DEFAULT_SHARED_LIMIT = 48 * 1024
_compiled = {}        # ids of (kernel, argument types) -> _Launcher
_thread = threading.local()   # .has_context: this thread made Numba's CUDA context current


def launch(kern, grid, block, shared_bytes, stream, *args, programmatic=False):
    """kern[grid, block, stream, shared_bytes](*args) for KernelView and NumPy int32/float32
    arguments; `stream` is a raw CUDA stream handle (0: the default stream). programmatic: launch
    with programmatic stream serialization (cuLaunchKernelEx; CUDA's programmatic dependent
    launch), so that the kernel may start before the one ahead of it on the stream has ended, as
    soon as each of that kernel's blocks has run `sm90.griddep_launch_dependents` (or exited); the
    kernel must run `sm90.griddep_wait` before it reads what that kernel writes. A CUDA graph
    captures it as a programmatic edge.

    On a GPU this skips Numba's per-call dispatch (typing every argument, wrapping arrays, building
    ctypes objects), which costs ~0.1 ms a call: the kernel is compiled once per argument types,
    and each call writes the flattened arguments (Numba's kernel ABI: an array is meminfo, parent,
    size, itemsize, data, shape..., strides...) into one buffer for cuLaunchKernel. It also raises
    the kernel's dynamic shared-memory limit when it asks for more than the default 48 KB
    (numba-cuda has no API for it: numba-cuda issue #94)."""
    if SIMULATOR:
        for a in args:   # what the GPU path below can pass, so that the simulator refuses the rest
            if not isinstance(a, KernelView) and type(a) not in _SCALAR_TYPES and not (
                    type(a) is tuple and all(type(x) is KernelView for x in a)):
                raise TypeError(f"launch takes KernelViews, tuples of them and np.int32 / "
                                f"np.uint32 / np.float32 scalars, got {type(a).__name__} {a!r}")
        kern[grid, block, 0, shared_bytes](*(
            a.array if isinstance(a, KernelView) else
            tuple(x.array for x in a) if type(a) is tuple else a for a in args))
        return
    if not getattr(_thread, "has_context", False):
        # cuLaunchKernel needs a current context in the calling thread, and callers are not all
        # on the thread that compiled the kernel: torch runs autograd backward on its own worker
        # threads. current_context() makes Numba's (the device's primary) context current here.
        cuda.current_context()
        _thread.has_context = True
    # keyed by identities (Numba types are interned in _ARRAY_TYPES and _SCALAR_TYPES; the
    # launcher keeps the kernel): hashing the types themselves costs ~1 us each
    key = (id(kern), *[id(a.layout.numba_type) if type(a) is KernelView else
                       tuple(id(x.layout.numba_type) for x in a) if type(a) is tuple else type(a)
                       for a in args])
    launcher = _compiled.get(key)
    if launcher is None:
        sig = tuple(_numba_type(a) for a in args)
        launcher = _compiled[key] = _Launcher(kern, sig)
    launcher(grid, block, shared_bytes, stream, args, programmatic)
    recording = getattr(_thread, "recording", None)
    if recording is not None:
        recording.append((launcher, grid, block, shared_bytes, stream, args, programmatic))


class _Launcher:
    """One compiled kernel and the driver calls that launch it.

    The kernel's parameters are 8-byte words (an array: meminfo, parent, size, itemsize, data,
    shape..., strides...; a 4-byte scalar: its bits in the low half of a word), packed by one
    `struct.Struct` into a buffer of this thread's whose word addresses (the void*[] cuLaunchKernel
    reads) are worked out once; the driver copies the parameters before cuLaunchKernel returns, so
    the buffer is free again at once."""

    def __init__(self, kern, sig):
        import struct

        import numpy as np
        from cuda.bindings import driver as cu

        from common.host import kernel_cache

        self.cu, self.np, self.kernel = cu, np, kern   # the kernel kept alive: launch keys by id
        self.cufunc = kernel_cache.load_or_compile(kern, sig)
        # A CUkernel handle may be passed to cuLaunchKernel cast to a CUfunction.
        self.function = cu.CUfunction(int(self.cufunc.handle))
        self.shared_allowed = _DEFAULT_SHARED_LIMIT
        self.streams = {}
        self.configs = {}   # programmatic launches: a CUlaunchConfig per (grid, block, smem, stream)
        self.buffers = threading.local()
        # an array: meminfo, parent, size, itemsize (q), data (Q), shape and strides (q); a scalar:
        # its 4 bytes, then 4 of padding
        self.struct = struct.Struct("<" + "".join(_format(t) for t in sig))
        self.words = self.struct.size // 8
        # CuPy's binding of cuLaunchKernel takes plain integers and checks nothing else: ~0.8 us a
        # launch less than cuda-python's, which converts its arguments (a launch is ~4 us).
        try:
            from cupy_backends.cuda.api.driver import launchKernel
            self.handle = int(self.cufunc.handle)
            self.launch_kernel = launchKernel
        except ImportError:
            self.launch_kernel = None

    def _buffer(self):
        buf = getattr(self.buffers, "slots", None)
        if buf is None:
            buf = self.buffers.slots = self.new_buffer()
        return buf

    def new_buffer(self):
        """(words, their addresses, the address of that void*[]): a parameter buffer."""
        np = self.np
        words = np.zeros(self.words, dtype=np.int64)
        pointers = words.__array_interface__["data"][0] + 8 * np.arange(self.words, dtype=np.uint64)
        # cuLaunchKernel takes the void*[]'s address as an int (no buffer request a call)
        return words, pointers, pointers.__array_interface__["data"][0]

    def pack(self, words, args):
        """Write the parameter words of `args` (KernelViews and NumPy scalars) into `words`."""
        values = []
        for a in _flat(args):
            if type(a) is KernelView:
                layout = a.layout
                values += layout.head
                values.append(a.ptr)
                values += layout.tail
            else:   # np.int32 / np.uint32 / np.float32
                values.append(a)
        self.struct.pack_into(words, 0, *values)

    def _programmatic_config(self, grid, block, shared_bytes, stream, cu_stream):
        key = (grid, block, shared_bytes, stream)
        config = self.configs.get(key)
        if config is None:
            cu = self.cu
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = block
            config.sharedMemBytes = shared_bytes
            config.hStream = cu_stream
            config.attrs = [attr]
            config.numAttrs = 1
            self.configs[key] = config
        return config

    def __call__(self, grid, block, shared_bytes, stream, args, programmatic=False):
        if shared_bytes > self.shared_allowed:
            cu = self.cu
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(cu.cuKernelSetAttribute(attr, shared_bytes, self.cufunc.handle,
                                           self.cufunc.device.id))
            self.shared_allowed = shared_bytes
        words, _, pointers = self._buffer()
        self.pack(words, args)
        self.launch_packed(dims3(grid), dims3(block), shared_bytes, stream, pointers, programmatic)

    def launch_packed(self, grid, block, shared_bytes, stream, pointers, programmatic=False):
        """cuLaunchKernel over parameters already packed (`pointers`: the void*[]'s address);
        grid and block 3-tuples."""
        if not programmatic and self.launch_kernel is not None:
            self.launch_kernel(self.handle, grid[0], grid[1], grid[2], block[0], block[1],
                               block[2], shared_bytes, stream, pointers, 0)
            return
        cu = self.cu
        cu_stream = self.streams.get(stream)
        if cu_stream is None:
            cu_stream = self.streams[stream] = cu.CUstream(stream)
        if programmatic:
            config = self._programmatic_config(grid, block, shared_bytes, stream, cu_stream)
            _check(cu.cuLaunchKernelEx(config, self.function, pointers, 0))
            return
        _check(cu.cuLaunchKernel(self.function, *grid, *block, shared_bytes, cu_stream, pointers, 0))


def dims3(dims):
    """A grid or block (an int or a tuple of 1 to 3) as a 3-tuple."""
    return (dims, 1, 1) if isinstance(dims, int) else tuple(dims) + (1,) * (3 - len(dims))


# --------------------------------------------------------------------------- recorded launches
# common/host/replay.py records a call's launches once and re-issues them with new addresses.

@contextmanager
def recording():
    """Within the block, every `launch` on this thread is also appended, as (launcher, grid, block,
    shared_bytes, stream, args, programmatic), to the list this yields (GPU only)."""
    outer = getattr(_thread, "recording", None)
    launches = _thread.recording = []
    try:
        yield launches
    finally:
        _thread.recording = outer


class PackedLaunch:
    """A recorded launch with its parameter words packed once: a replay writes the addresses of
    the views in `slots` ((word, base, offset): word <- bases[base] + offset) and launches."""
    __slots__ = ("launcher", "grid", "block", "shared_bytes", "programmatic", "words", "slots")

    def __init__(self, record, resolve):
        """record: one of `recording`'s; resolve(view) -> (base, offset), or None for a view whose
        address is the same in every call."""
        launcher, grid, block, shared_bytes, _, args, programmatic = record
        self.launcher, self.shared_bytes, self.programmatic = launcher, shared_bytes, programmatic
        self.grid, self.block = dims3(grid), dims3(block)
        self.words = launcher.new_buffer()[0]
        launcher.pack(self.words, args)
        slots, at = [], 0
        for a in _flat(args):
            if type(a) is KernelView:
                where = resolve(a)
                if where is not None:
                    slots.append((at + 4, *where))   # meminfo, parent, size, itemsize, data
                at += 5 + 2 * len(a.layout.shape)
            else:
                at += 1
        self.slots = tuple(slots)


def replay(launches, buffers, bases, stream):
    """Issue PackedLaunches on `stream` with the views' addresses worked out from `bases`;
    buffers: this thread's copy of each one's words (`replay_buffers`)."""
    if not getattr(_thread, "has_context", False):
        cuda.current_context()
        _thread.has_context = True
    for step, (words, _, pointers) in zip(launches, buffers):
        for word, base, offset in step.slots:
            words[word] = bases[base] + offset
        step.launcher.launch_packed(step.grid, step.block, step.shared_bytes, stream, pointers,
                                    step.programmatic)


def replay_buffers(launches):
    """A thread's own parameter buffers for `replay` (two threads may replay one call at once)."""
    buffers = []
    for step in launches:
        buf = step.launcher.new_buffer()
        buf[0][:] = step.words
        buffers.append(buf)
    return buffers


def _flat(args):
    """The arguments with each tuple's members in its place (Numba's kernel ABI flattens tuples)."""
    for a in args:
        if type(a) is tuple:
            yield from a
        else:
            yield a


def _numba_type(a):
    """What the kernel is compiled for: a view's array type, a tuple of views' Tuple type (a
    score_mod's aux arrays), a scalar's type."""
    if isinstance(a, KernelView):
        return a.numba_type
    if type(a) is tuple:
        from numba import types
        return types.Tuple(tuple(x.numba_type for x in a))
    return _SCALAR_TYPES[type(a)]


def _format(t):
    """struct format of a parameter of Numba type t: an array's words, a tuple's members', a
    scalar's 4 bytes and padding."""
    if hasattr(t, "ndim"):
        return f"4qQ{2 * t.ndim}q"
    if hasattr(t, "types"):
        return "".join(_format(m) for m in t.types)
    return _SCALAR_FORMATS[str(t)]


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")


def _scalar_types():
    import numpy as np
    from numba import types
    return {np.int32: types.int32, np.uint32: types.uint32, np.float32: types.float32}


_SCALAR_TYPES = _scalar_types()
_SCALAR_FORMATS = {"int32": "i4x", "uint32": "I4x", "float32": "f4x"}   # struct: 4 bytes + padding
