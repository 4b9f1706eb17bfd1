"""TMA tensor maps: the 128-byte descriptors that Hopper's bulk tensor copies (common/hardware/sm90.py's
tma_load_4d and tma_store_4d) read, made on the host. A map over a (B, H, N, d) view is encoded by
the driver (cuTensorMapEncodeTiled: dimensions, strides, the box, SWIZZLE_128B), uploaded into a
(maps, 16) uint64 device array that the kernel takes as an argument, and cached per (address,
shape, strides, element, box); in the simulator its words name the array in sm90's registry of
simulated maps (sm90.register_tensor_map).

Host-only: kernels get the maps as an argument and no kernel or device function reaches this
module; like all of common/host/ it is left out of common/host/kernel_cache.py's key, and an edit to it keeps every
compiled kernel (tests/test_compile.py checks that none reaches it).

A new map is uploaded by a copy on the stream of the launch that reads it, and the host waits for
that copy to land: a launch on any stream then reads the whole map, a non-blocking stream's
included (a synchronous copy on the legacy stream, as before, returns once the bytes are staged,
not landed, and orders nothing on a non-blocking stream). The wait costs what the synchronous
copy cost: the stream's earlier work, once per new map. (A wait on the GPU instead would need an
event wait by every later stream, which CUDA-graph capture refuses.)

CUDA graphs: a graph cannot hold a copy from pageable memory. Under stream capture only maps
already made are usable, i.e. of inputs the kernel saw once before the capture; a new one is an
error that says so (`tensor_maps`). common/host/replay.py makes a replayed call's maps for its own
addresses through `replay.derived`.
"""
import numpy as np
from numba import cuda

from common.hardware import sm90
from common.hardware.target import SIMULATOR
from common.host.launching import KernelView

_MAP_CACHE = {}
_MAP_CACHE_SIZE = 256


def tensor_maps(boxes, stream=0):
    """A (len(boxes), 16) uint64 device array of tensor maps, as a KernelView for `launch`:
    boxes = ((view, box_rows, box_cols), ...) over (B, H, N, d) KernelViews of 32-, 16- or 8-bit
    elements, a box 128 bytes wide. A map depends only on (address, shape, strides, element, box),
    so maps are encoded and uploaded once per such key.

    The upload is a copy on `stream` (a raw handle, that of the launch that reads the maps) from
    pageable memory, which a CUDA graph cannot hold: under stream capture (on `stream`) only maps
    already made are usable, i.e. inputs the kernel saw once before the capture, and a new one is
    an error that says so. (Graph-safe maps need them passed by value as __grid_constant__ kernel
    parameters, which Numba kernels cannot declare.)"""
    key = tuple((v.ptr, v.shape, v.strides, v.dtype.itemsize, r, c) for v, r, c in boxes)
    hit = _MAP_CACHE.get(key)
    if hit is None:
        if not SIMULATOR and stream_is_capturing(stream):
            raise RuntimeError(
                "fa3 under CUDA-graph capture: its TMA tensor maps are made once per input "
                "address, by a copy a graph cannot hold, and these inputs were not seen before the "
                "capture. Run the same call once before capturing, with the tensors the graph "
                "will use (static inputs), or capture a variant without TMA (fa2).")
        words = np.stack([encode_tensor_map(v, r, c) for v, r, c in boxes])
        dev = _upload(words, stream)
        if len(_MAP_CACHE) >= _MAP_CACHE_SIZE:
            _MAP_CACHE.pop(next(iter(_MAP_CACHE)))
        hit = _MAP_CACHE[key] = KernelView(
            dev.__cuda_array_interface__["data"][0] if not SIMULATOR else 0, words.shape,
            (16 * 8, 8), np.dtype(np.uint64), owner=dev, array=dev)
    return hit


def _upload(words, stream):
    """`words` in a new device array, landed: copied on `stream`, then waited for."""
    if SIMULATOR:
        return cuda.to_device(words)
    numba_stream = cuda.default_stream() if stream == 0 else cuda.external_stream(stream)
    dev = cuda.device_array(words.shape, words.dtype)   # (an array made with a stream names it
    dev.copy_to_device(words, stream=numba_stream)      # in its array interface: not this one)
    numba_stream.synchronize()
    return dev


def stream_is_capturing(stream):
    """True while raw CUDA stream handle `stream` is being captured into a graph."""
    from cuda.bindings import driver as cu
    err, status = cu.cuStreamIsCapturing(cu.CUstream(stream))
    if int(err) != 0:
        raise RuntimeError(f"cuStreamIsCapturing: CUDA driver error {err!r}")
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


if SIMULATOR:
    def encode_tensor_map(view, box_rows, box_cols):
        """The simulator's map over `view`: its 16 words name the array in the registry that sm90's
        simulated bulk tensor copies read."""
        return sm90.register_tensor_map(view, box_rows, box_cols)

else:
    def encode_tensor_map(view, box_rows, box_cols):
        """cuTensorMapEncodeTiled over a (B, H, N, d) view of 32-bit (16-bit pairs), 16-bit or 8-bit
        (e4m3, as UINT8: the copy engine moves bits) elements (any strides, the last axis
        contiguous): dimensions innermost first (d, N, H, B), a box of box_cols x box_rows x 1 x 1,
        SWIZZLE_128B, zeros past the ends. Returns its 16 words (128 bytes)."""
        from cuda.bindings import driver as cu
        kind = {4: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32,
                2: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,
                1: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8}[view.dtype.itemsize]
        b, h, n, d = view.shape
        sb, sh, sn, sd = view.strides
        dims = [cu.cuuint64_t(x) for x in (d, n, h, b)]
        strides = [cu.cuuint64_t(x) for x in (sn, sh, sb)]
        box = [cu.cuuint32_t(x) for x in (box_cols, box_rows, 1, 1)]
        ones = [cu.cuuint32_t(1)] * 4
        err, tmap = cu.cuTensorMapEncodeTiled(
            kind, cu.cuuint32_t(4), view.ptr,
            dims, strides, box, ones, cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if int(err) != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err!r}) for shape {view.shape}, "
                               f"strides {view.strides}, box {box_rows}x{box_cols}")
        return np.array([int(w) for w in tmap.opaque], dtype=np.uint64)
