"""Device arrays from CuPy, Numba and torch, seen by the kernels as zero-copy Numba views.

The kernels take 16-bit inputs as uint16 bit patterns (the tensor cores read the bits; Numba has no
bfloat16 shared/local arrays), so every input is re-viewed, never copied: `bits_view` turns any
supported device array into a Numba device array of uint16/uint32/float32 with the same memory and
any axis order. Outputs are allocated with the library of the inputs (`empty`), so a CuPy user gets
CuPy arrays back, a torch user torch tensors.
"""
from dataclasses import dataclass
from functools import lru_cache

import ml_dtypes
import numpy as np
from numba import cuda

from common.hardware.target import SIMULATOR
from common.host.launching import KernelView, view_layout

# The element types this project handles, by the names used in configs, CSVs and error messages.
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
          "float32": np.dtype(np.float32), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
          "uint8": np.dtype(np.uint8), "int32": np.dtype(np.int32)}


def _torch_module(x):
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if isinstance(x, torch.Tensor):
            return torch
    return None


def _is_simulator_array(x):
    if not SIMULATOR:
        return False
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return isinstance(x, FakeCUDAArray)


@dataclass
class Described:
    """What the kernels need to know of an array: where it is and how it is laid out."""
    library: str          # "torch" | "cupy" | "numba" | "sim" | "cai" (any __cuda_array_interface__)
    ptr: int
    shape: tuple
    strides: tuple        # bytes
    dtype: str            # numpy-style name: "bfloat16", "float16", "float32", ...
    itemsize: int
    owner: object


def describe(x, name="array"):
    """Describe a device array or raise TypeError naming what is wrong with it."""
    torch = _torch_module(x)
    if torch is not None:
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on {x.device}; pass a CUDA tensor")
        dtype, size = _torch_dtype(x.dtype)
        return Described("torch", x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()),
                         dtype, size, x)
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a host (NumPy) array; pass a device array (CuPy, a Numba device "
                        f"array or a torch CUDA tensor), e.g. numba.cuda.to_device({name})")
    if _is_simulator_array(x):
        a = vars(x)["_ary"]
        return Described("sim", a.ctypes.data, a.shape, a.strides, a.dtype.name, a.dtype.itemsize, x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{name} of type {type(x).__name__} is not a device array (no "
                        "__cuda_array_interface__); pass CuPy, Numba device arrays or torch CUDA tensors")
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides") or contiguous_strides(shape, dtype.itemsize)
    mod = type(x).__module__
    library = "cupy" if mod.startswith("cupy") else "numba" if mod.startswith("numba") else "cai"
    return Described(library, cai["data"][0], shape, tuple(strides), dtype.name, dtype.itemsize, x)


_TORCH_DTYPES = {}


def _torch_dtype(dtype):
    """(name, itemsize) of a torch dtype, e.g. ("bfloat16", 2)."""
    hit = _TORCH_DTYPES.get(dtype)
    if hit is None:
        hit = _TORCH_DTYPES[dtype] = (str(dtype).replace("torch.", ""), dtype.itemsize)
    return hit


def contiguous_strides(shape, itemsize):
    """The byte strides of a C-contiguous array of that shape."""
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def bits_view(d, element, axes=None, last_dim_divisor=1):
    """A kernel argument (`launching.KernelView`) over the memory of described array `d`, with
    elements of type `element` (np.uint16, np.uint32 or np.float32), axes permuted by `axes`, and
    the contiguous last axis shrunk by `last_dim_divisor` when wider elements pair up narrower ones
    (uint32 over 16-bit). Nothing is allocated or copied.

    In the simulator the view's `.array` is built from NumPy's array interface over the same
    descriptor, so the simulator exercises exactly the shapes and strides the GPU kernels get."""
    view = KernelView.over(d.ptr, view_layout_of(d.shape, d.strides, d.itemsize, element, axes,
                                                 last_dim_divisor), d.owner)
    if d.library == "sim":
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        host = _HostView(view.__cuda_array_interface__, vars(d.owner)["_ary"])
        view._array = FakeCUDAArray(np.asarray(host))
    return view


@lru_cache(maxsize=4096)
def view_layout_of(shape, strides, itemsize, element, axes=None, last_dim_divisor=1):
    """The launching.ViewLayout of bits_view's view of an array of that geometry: pure arithmetic,
    once per geometry."""
    shape, strides = list(shape), list(strides)
    dtype = np.dtype(element)
    if dtype.itemsize != itemsize * last_dim_divisor:
        raise ValueError(f"cannot view {itemsize}-byte elements {last_dim_divisor} at a time as "
                         f"{dtype.itemsize}-byte {dtype.name}")
    if last_dim_divisor != 1:
        if strides[-1] != itemsize or shape[-1] % last_dim_divisor:
            raise ValueError("pairing elements needs a contiguous last axis of even length")
        shape[-1] //= last_dim_divisor
        strides[-1] = dtype.itemsize
    if axes is not None:
        shape = [shape[a] for a in axes]
        strides = [strides[a] for a in axes]
    return view_layout(tuple(shape), tuple(strides), dtype)


class _HostView:
    """NumPy's array interface over the simulator's host memory; keeps the owner alive."""

    def __init__(self, desc, owner):
        self.__array_interface__ = desc
        self.owner = owner


def empty(library, shape, dtype, like=None):
    """A new device array of `library`'s own type, dtype one of DTYPES ('float8_e4m3fn' for torch
    only: CuPy and Numba keep e4m3 as its 'uint8' bits); for torch on `like`'s device (none: the
    current one)."""
    if library == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype),
                           device=like.device if like is not None else "cuda")
    np_dtype = DTYPES[dtype]
    if library == "cupy":
        import cupy
        return cupy.empty(shape, dtype=np_dtype)
    return cuda.device_array(shape, dtype=np_dtype)  # numba, the simulator, and anything else


def zeros(library, shape, dtype, like=None):
    """`empty`, filled with zeros (by the library, on the caller's stream)."""
    if library == "torch":
        import torch
        return torch.zeros(shape, dtype=getattr(torch, dtype),
                           device=like.device if like is not None else "cuda")
    if library == "cupy":
        import cupy
        return cupy.zeros(shape, dtype=DTYPES[dtype])
    return cuda.to_device(np.zeros(shape, dtype=DTYPES[dtype]))


_PLACEHOLDERS = {}


def placeholder(library, ndim, like=None, dtype="float32"):
    """A kernel argument (zeros of shape (1,) * ndim, made once per library and device) for an
    array parameter that a kernel's configuration does not read (fa3's descales with 16-bit
    inputs, the quantiser's signs without incoherent processing, fa2's cu_seqlens without varlen).

    For torch it is the driver's memory (a Numba array), not the caching allocator's: the first
    call may come while torch.compile's CUDA graphs (mode="reduce-overhead") warm up in their
    private pool, which must hold nothing that outlives a replay. Inside a stream capture, where
    the driver may not allocate, it is the caller's (the graph's pool keeps it)."""
    device = like.device.index if library == "torch" else None
    key = (library, ndim, dtype, device)
    hit = _PLACEHOLDERS.get(key)
    if hit is None:
        shape = (1,) * ndim
        if library == "torch" and not _torch_module(like).cuda.is_current_stream_capturing():
            with cuda.gpus[device]:
                arr = cuda.to_device(np.zeros(shape, dtype=DTYPES[dtype]))
        else:
            arr = zeros(library, shape, dtype, like=like)
        hit = _PLACEHOLDERS[key] = (bits_view(describe(arr), DTYPES[dtype]), arr)
    return hit[0]


def is_placeholder(view):
    """True if `view` is one of `placeholder`'s (kept for the life of the process)."""
    return any(view is hit[0] for hit in _PLACEHOLDERS.values())


def to_host(x):
    """A NumPy copy of a (small) device array of any supported library (waits for it)."""
    if _torch_module(x) is not None:
        return x.detach().cpu().numpy()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if type(x).__module__.startswith("cupy"):
        return x.get()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"cannot read an array of type {type(x).__name__} back to the host")


def torch_stream(device_index):
    """The raw handle of torch's current stream on a device: torch's own C getter (what torch's
    compiled kernels launch with; 0.1 us), or, if a torch version lacks it, the public API (3 us)."""
    import torch
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def empty_with_view(library, shape, dtype, element, like=None, last_dim_divisor=1):
    """(a new contiguous device array of `library` (see `empty`), its bits_view as `element`s):
    an output and the kernel's view of it, without describing the new array (torch)."""
    x = empty(library, shape, dtype, like=like)
    if library != "torch":
        return x, bits_view(describe(x), element, None, last_dim_divisor)
    itemsize = DTYPES[dtype].itemsize
    shape = tuple(shape)
    return x, KernelView.over(x.data_ptr(), view_layout_of(
        shape, contiguous_strides(shape, itemsize), itemsize, element, None, last_dim_divisor), x)


SCRATCH_ALIGN = 256   # bytes between the work arrays `empty_views` carves from one allocation


def views_bytes(specs):
    """Bytes of one allocation that holds the work arrays of `specs` ((shape, element) pairs, each
    256-byte aligned) for `views_over`."""
    at = 0
    for shape, element in specs:
        size = np.dtype(element).itemsize
        for n in shape:
            size *= n
        at += (size + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
    return max(at, SCRATCH_ALIGN)


def empty_views(library, specs, like=None):
    """Kernel views of new contiguous work arrays, one per (shape, element) in `specs` (element a
    NumPy type: np.float32, np.uint16, ...), carved from ONE allocation of `library`: a call's
    scratch costs one allocator call, not one an array. Each view keeps the whole allocation
    alive."""
    return views_over(empty(library, (views_bytes(specs),), "uint8", like=like), specs)


_CARVINGS = {}   # specs -> ((offset, ViewLayout) of each work array, bytes in all)
_KEPT = 4096     # geometries a per-call cache keeps before it starts over (packed batches of
#                  ever-new lengths must not grow it without end)


def _carving(specs):
    """Where each work array of `specs` lies in one allocation and its layout, worked out once per
    specs (a call repeats the last call's: ~1.5 us of Python an array otherwise)."""
    hit = _CARVINGS.get(specs)
    if hit is None:
        at, parts = 0, []
        for shape, element in specs:
            itemsize = np.dtype(element).itemsize
            shape = tuple(shape)
            parts.append((at, view_layout_of(shape, contiguous_strides(shape, itemsize),
                                             itemsize, element)))
            size = itemsize
            for n in shape:
                size *= n
            at += (size + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
        if len(_CARVINGS) >= _KEPT:
            _CARVINGS.clear()
        hit = _CARVINGS[specs] = (tuple(parts), at)
    return hit


def views_over(buf, specs):
    """Kernel views of contiguous arrays of `specs` ((shape, element) pairs) laid one after another
    (each 256-byte aligned) in `buf`, a 1-D uint8 device array of at least views_bytes(specs)
    bytes: a packed batch's sequences carve theirs from one allocation, one sequence after
    another (their kernels run in stream order)."""
    torch_buf = _torch_module(buf) is not None
    if torch_buf and type(specs) is tuple:   # the per-call path: layouts known per specs
        parts, end = _carving(specs)
        if end > buf.numel():
            raise ValueError(f"work arrays of {end} bytes do not fit a {buf.numel()}-byte buffer")
        start = buf.data_ptr()
        return [KernelView.over(start + at, layout, buf) for at, layout in parts]
    d = None if torch_buf else describe(buf)
    at = start = buf.data_ptr() if torch_buf else d.ptr
    views = []
    for shape, element in specs:
        itemsize = np.dtype(element).itemsize
        shape = tuple(shape)
        strides = contiguous_strides(shape, itemsize)
        if torch_buf:
            views.append(KernelView.over(at, view_layout_of(shape, strides, itemsize, element),
                                         buf))
        else:   # the simulator's views need their host arrays: bits_view over the carved part
            views.append(bits_view(Described(d.library, at, shape, strides,
                                             np.dtype(element).name, itemsize, buf), element))
        size = itemsize
        for n in shape:
            size *= n
        at += (size + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
    have = buf.numel() if torch_buf else d.shape[0]
    if at - start > have:
        raise ValueError(f"work arrays of {at - start} bytes do not fit a {have}-byte buffer")
    return views


_RETYPED = {}   # (layout, element, last_dim_divisor) -> the layout as_elements gives


def as_elements(view, element, last_dim_divisor=1):
    """Another kernel view of a contiguous kernel view's memory (one from `empty_views`), in its
    axis order, as `element`s (see bits_view): e.g. 16-bit P as pairs (uint32) for one kernel and
    as uint16 for the next."""
    if not SIMULATOR:   # the per-call path: the new layout worked out once per layout
        key = (view.layout, element, last_dim_divisor)
        layout = _RETYPED.get(key)
        if layout is None:
            if len(_RETYPED) >= _KEPT:
                _RETYPED.clear()
            dtype = view.dtype
            layout = _RETYPED[key] = view_layout_of(view.shape, view.strides, dtype.itemsize,
                                                    element, None, last_dim_divisor)
        return KernelView.over(view.ptr, layout, view.owner)
    dtype = view.dtype
    return bits_view(Described("sim" if SIMULATOR else "view", view.ptr, view.shape, view.strides,
                               dtype.name, dtype.itemsize, view.owner), element, None,
                     last_dim_divisor)


def row_range(view, start, stop, unit_axis=False):
    """The kernel view of rows start .. stop - 1 (axis 2) of a (B, H, N, ...) kernel view: the
    same memory, no copy (one sequence of a packed batch). unit_axis: a trailing axis of one
    element appended ((B, H, N) -> (B, H, N, 1)), so that a 3-D view goes where 4-D ones do."""
    shape = view.shape[:2] + (stop - start,) + view.shape[3:] + ((1,) if unit_axis else ())
    strides = view.strides + ((view.dtype.itemsize,) if unit_axis else ())
    sub = KernelView.over(view.ptr + start * view.strides[2], view_layout(shape, strides, view.dtype),
                          view.owner)
    if SIMULATOR:
        sub._array = view.array[:, :, start:stop, ..., None] if unit_axis else \
            view.array[:, :, start:stop]
    return sub


def stream_of(d):
    """The raw handle of the stream the caller's library is working on (kernels launch there),
    or 0 for the default stream."""
    if d.library == "torch":
        return torch_stream(d.owner.device.index)
    if d.library == "cupy":
        import cupy
        return cupy.cuda.get_current_stream().ptr
    return 0


def copy_from_host(x, host):
    """Copy host array `host` (x's shape) into device array x, in place; returns x."""
    host = np.ascontiguousarray(host)
    mod = type(x).__module__
    if mod.startswith("torch"):   # through fp32: torch takes no NumPy (ml_dtypes) bfloat16
        import torch
        x.copy_(torch.from_numpy(host.astype(np.float32)).to(x.device, x.dtype))
        return x
    if mod.startswith("cupy"):
        x.set(host.astype(x.dtype))
        return x
    if x.size:
        _numba_bits(x).copy_to_device(_host_bits(host.astype(x.dtype)))
    return x


def to_device(x, library):
    """Copy host array x to the device as a `library` array of the same dtype."""
    x = np.ascontiguousarray(x)
    if library == "torch":
        import torch
        if x.dtype == DTYPES["bfloat16"]:
            return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
        return torch.from_numpy(x).cuda()
    if library == "cupy":
        import cupy
        return cupy.asarray(x)
    from numba import cuda
    dev = cuda.device_array(x.shape, dtype=x.dtype)
    _numba_bits(dev).copy_to_device(_host_bits(x))
    return dev


def _host_bits(x):
    return x.view(np.uint16) if x.dtype == DTYPES["bfloat16"] else x


def _numba_bits(x):
    """Numba copies through the buffer protocol, which refuses ml_dtypes' bfloat16: move its bits."""
    return x.view(np.uint16) if x.dtype == DTYPES["bfloat16"] else x


def fill(x, value):
    """Set every element of device array x to `value` (on the caller's stream for torch and CuPy);
    returns x."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        x.fill_(value)
        return x
    if mod.startswith("cupy"):
        x.fill(value)
        return x
    if x.size:
        full = np.full(x.shape, value, dtype=np.float32).astype(x.dtype)
        _numba_bits(x).copy_to_device(_host_bits(full))
    return x
