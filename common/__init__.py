"""The layer every variant is built on: PTX intrinsics with simulator stand-ins (`ptx`), shared-memory
tiles, fragments and warp GEMMs (`tiles`), online-softmax row operations and their backward
(`softmax`), what every backward pass shares (`backward`), the float64 reference and its gradients
(`reference`), array adapters (`arrays`), inputs, FLOP counts and timing.

This package's own import is deliberately light (no numba): call `select_backend()` before anything
imports numba when the choice between GPU and simulator should be made automatically.
"""
import os


def select_backend():
    """Choose Numba's CUDA simulator when this machine has no usable CUDA GPU.

    Must run before numba is imported (numba reads NUMBA_ENABLE_CUDASIM once). An explicit
    NUMBA_ENABLE_CUDASIM in the environment wins. Returns "sim" or "gpu"."""
    flag = os.environ.get("NUMBA_ENABLE_CUDASIM")
    if flag is None:
        flag = "0" if gpu_count() > 0 else "1"
        os.environ["NUMBA_ENABLE_CUDASIM"] = flag
    return "sim" if flag not in ("", "0") else "gpu"


def gpu_count():
    """CUDA GPUs the driver shows this process (CUDA_VISIBLE_DEVICES applies), without numba: 0
    when there is no driver."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
