"""Where kernels run: a CUDA GPU or Numba's CUDA simulator, and the decorators that work on both."""
from numba import config, cuda

SIMULATOR = bool(config.ENABLE_CUDASIM)

if SIMULATOR:
    import sys

    # The simulator runs each CUDA thread as a Python thread and every barrier hands the GIL to all
    # of them; the default 5 ms switch interval makes each barrier cost ~40 ms, 0.2 ms about 7 ms.
    sys.setswitchinterval(2e-4)

# Every helper in common/ is inlined into its kernel at Numba-IR level. That is what lets NVVM
# unroll the fragment loops and keep fragments in registers; it also lets compile_ptx work on a
# machine without a GPU (numba-cuda 0.30 asks the current device for a non-inlined device function).
device_function = cuda.jit(device=True, inline="always")


# Kernels: lazily compiled, one specialisation per argument types (tile sizes are closed over).
kernel = cuda.jit


def gpu_available():
    """True when kernels run on a real CUDA GPU (not the simulator)."""
    if SIMULATOR:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # no driver at all
        return False


def describe():
    """One line naming where kernels run."""
    if SIMULATOR:
        return "Numba CUDA simulator (CPU)"
    if not gpu_available():
        return "no CUDA GPU"
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return f"{name} (sm_{dev.compute_capability[0]}{dev.compute_capability[1]})"


_DEFAULT_SHARED_LIMIT = 48 * 1024
_raised = set()


def launch(kern, grid, block, shared_bytes, stream, *args):
    """kern[grid, block, stream, shared_bytes](*args), first raising the kernel's dynamic
    shared-memory limit when it asks for more than the default 48 KB (numba-cuda has no API for it:
    numba-cuda issue #94)."""
    if shared_bytes > _DEFAULT_SHARED_LIMIT and not SIMULATOR:
        _allow_dynamic_shared(kern, args, shared_bytes)
    kern[grid, block, stream, shared_bytes](*args)


def _allow_dynamic_shared(kern, args, shared_bytes):
    from numba import typeof
    from numba.cuda.cudadrv import driver as drv

    sig = tuple(typeof(a) for a in args)
    key = (id(kern), sig, shared_bytes)
    if key in _raised:
        return
    compiled = kern.compile(sig)
    cufunc = compiled._codelibrary.get_cufunc()
    attr = drv.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    drv.driver.cuKernelSetAttribute(attr, shared_bytes, cufunc.handle, cufunc.device.id)
    _raised.add(key)
