"""Where kernels run: a CUDA GPU or Numba's CUDA simulator, the decorators that work on both, and
the hardware facts a kernel is built for. Launching is the host layer's (common/host/launching.py)."""
import re
from functools import lru_cache

from numba import config, cuda

SIMULATOR = bool(config.ENABLE_CUDASIM)

if SIMULATOR:
    # The simulator runs each CUDA thread as a Python thread. Its block manager polls for barriers;
    # common/hardware/_sim_block.py's lets the last thread to arrive release the others (a barrier of 128
    # threads ~2.6 ms instead of ~7; the simulated suite ~2.3x faster).
    from common.hardware import _sim_block

    _sim_block.install()
else:
    # Numba's frontend without three costs that grow with our kernels' size (the inliner's copies
    # of IR nobody else holds, liveness swept in label order, SSA rewrites of every block for
    # every variable): a cold compile a quarter as long, the PTX unchanged (frontend.py)
    from common.hardware import frontend

    frontend.install()

# Every helper in common/ is inlined into its kernel at Numba-IR level. That is what lets NVVM
# unroll the fragment loops and keep fragments in registers; it also lets compile_ptx work on a
# machine without a GPU (numba-cuda 0.30 asks the current device for a non-inlined device function).
device_function = cuda.jit(device=True, inline="always")


# Kernels: lazily compiled, one specialisation per argument types (tile sizes are closed over).
if SIMULATOR:
    def kernel(fn):
        """cuda.jit of `fn`, whose every simulated thread checks, once the body returns, that it
        left no asynchronous copy or MMA in flight (_sim_collectives.check_at_exit). The simulator
        swaps the `cuda` name in the kernel function's globals for its fake module, so the wrapper
        gets `fn`'s globals (the kernel module's)."""
        import functools
        import types

        from common.hardware import _sim_collectives

        check = _sim_collectives.check_at_exit

        def body(*args):
            fn(*args)
            check()

        checked = types.FunctionType(body.__code__, fn.__globals__, fn.__name__, None,
                                     body.__closure__)
        return cuda.jit(functools.wraps(fn)(checked))
else:
    kernel = cuda.jit


def kernel_with_launch_bounds(threads, min_blocks):
    """`kernel` with launch bounds (threads, min_blocks) when min_blocks > 0 (`kernel` itself
    otherwise, and in the simulator, which has no launch bounds): ptxas may give each thread up to
    65536 / (threads * min_blocks) registers and no more, and schedules knowing it has them. Without
    bounds it assumes nothing of the block and, measured on fa2's forward at d=192 (8 warps, 173
    registers), gives every ldmatrix the register the mma before it read, so that each pair of mma
    waits out a shared-memory load; with (256, 1) it takes 214 and loads a pair ahead."""
    if SIMULATOR or not min_blocks:
        return kernel
    return cuda.jit(launch_bounds=(threads, min_blocks))


def kernel_for_one_block_per_sm(threads):
    """`kernel` with launch bounds (threads, 1): ptxas may give each thread up to 65536 / threads
    registers (rounded down to 8) and no more, so a block of `threads` always launches (warp-
    specialised kernels of 288 threads, whose consumers want ~200). The simulator has no launch
    bounds."""
    if SIMULATOR:
        return kernel
    return cuda.jit(launch_bounds=(threads, 1))


# --------------------------------------------------------------------------- loop unrolling
# The fragment arrays (`cuda.local.array`) are registers only if every loop that indexes them is
# unrolled completely. NVVM decides that by a size threshold, and with two m16 tiles a warp at
# head_dim 128 the GEMM loops exceed it: the loops stay rolled, their arrays go to local memory.
# CUDA C++ says `#pragma unroll` for this; its IR form is `llvm.loop.unroll.full` metadata on the
# loop's back edge, which Numba cannot emit. So before NVVM sees a kernel's IR, every back edge gets
# that metadata (the `#pragma unroll` of every loop). Only loops with a trip count known at compile
# time unroll (all loops over tile and fragment shapes here); the others (the K/V loop over a
# runtime length) are left as they are.

_BACK_EDGE = re.compile(r"^(\s+br label %(\"[^\"]+\"|[\w.$-]+))\s*$")
_LABEL = re.compile(r"^(\"[^\"]+\"|[\w.$-]+):")


def unroll_all_loops(llvm_ir):
    """`llvm_ir` (textual LLVM IR) with `llvm.loop.unroll.full` on every loop back edge, i.e. every
    unconditional branch to a block defined earlier in the same function."""
    next_id = max(map(int, re.findall(r"!(\d+)", llvm_ir)), default=0) + 1
    lines, metadata, seen = [], [], set()
    for line in llvm_ir.splitlines():
        if line.startswith("define "):
            seen = set()
        label = _LABEL.match(line)
        if label:
            seen.add(label.group(1).strip('"'))
        edge = _BACK_EDGE.match(line)
        if edge and edge.group(2).strip('"') in seen:
            line = f"{edge.group(1)}, !llvm.loop !{next_id}"
            metadata += [f"!{next_id} = distinct !{{!{next_id}, !{next_id + 1}}}",
                         f'!{next_id + 1} = !{{!"llvm.loop.unroll.full"}}']
            next_id += 2
        lines.append(line)
    return "\n".join(lines + metadata) + "\n"


def _install_unroll_pass():
    """Route the IR of every Numba CUDA kernel compiled in this process through unroll_all_loops
    (numba-cuda 0.30: CUDACodeLibrary.llvm_strs is what it hands to NVVM)."""
    from numba.cuda.codegen import CUDACodeLibrary

    if getattr(CUDACodeLibrary, "_fa_unrolls_loops", False):
        return

    def llvm_strs(self):
        if self._llvm_strs is None:
            self._llvm_strs = [unroll_all_loops(str(mod)) for mod in self.modules]
        return self._llvm_strs

    CUDACodeLibrary.llvm_strs = property(llvm_strs)
    CUDACodeLibrary._fa_unrolls_loops = True


if not SIMULATOR:
    _install_unroll_pass()


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


@lru_cache(maxsize=None)
def multiprocessor_count():
    """SMs of the current GPU (the simulator: 1)."""
    if SIMULATOR:
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


MAX_SHARED_BYTES = 227 * 1024   # dynamic shared memory a thread block may opt into (sm_90)
