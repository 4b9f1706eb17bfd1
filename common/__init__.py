"""The layers every variant is built on, one sub-package each, imports pointing down only
(docs/architecture.md; tests/test_layers.py checks it):
  common/hardware/  PTX instructions beside their simulator stand-ins, element types, decorators
  common/tile/      the device functions kernels are made of: tiles, softmax, masks, pipelines
  common/host/      a call's host side: checks and views, configs, launch, kernel cache, replay

This package's own import is deliberately light (no numba): call `select_backend()` before anything
imports numba when the choice between GPU and simulator should be made automatically (`gpu_count()`
asks the driver, without numba).
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
