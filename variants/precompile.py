"""Compile the common configurations' kernels into the kernel cache, in parallel processes; show or
empty the cache.

    python -m variants.precompile [--variants fa2,fa3] [--head-dims 64,128]
                                  [--dtypes bfloat16,float16] [--causal both] [--passes fwd,bwd]
                                  [--jobs N]
    python -m variants.precompile --info     # the cache's directory, entries and size
    python -m variants.precompile --clear    # remove its files

Each configuration (variant, pass, head_dim, dtype, causal) is one call of the real entry point,
`variants.forward` or `variants.backward`, on small random inputs in flash_attn's layout
(B, N, H, d), contiguous, with H > 1 and N a multiple of every block size: the same configuration
resolution and the same argument types (an array's layout is part of the Numba signature) as a
user's first call with default options, so exactly the kernels that call needs land in the
cache (common/host/kernel_cache.py, where and how: docs/compile_cache.md). The configurations run
in `--jobs` processes (spawn; each one runs its share of the configurations and sets nothing
else); fa3 only on an sm_90 GPU. Without a GPU (Numba's CUDA simulator compiles nothing) there is
nothing to precompile: the command says so and exits 0.
"""
import argparse
import os
import sys
import time

import common

PASSES = ("fwd", "bwd")
DEFAULTS = {"variants": "fa2,fa3", "head_dims": "64,128", "dtypes": "bfloat16,float16",
            "causal": "both", "passes": "fwd,bwd"}
DTYPE_NAMES = ("bfloat16", "float16")
# The inputs: B, N, H. H > 1 keeps the kernels' (B, H, N, d) views strided (Numba's layout "A"),
# as with a user's tensors (H = 1 would make them C-contiguous: another signature); N = 4480 is a
# multiple of every block size (64, 80, 112, 128).
BATCH, SEQLEN, HEADS = 1, 4480, 2
NO_GPU = ("No CUDA GPU here: nothing to precompile (Numba's CUDA simulator, which runs the kernels "
          "without one, compiles nothing).")


def main(argv=None):
    """The command line; returns the exit status."""
    args = parse(argv)
    common.select_backend()   # before numba loads
    from common.host import kernel_cache
    if args.info or args.clear:
        return show_or_clear(kernel_cache, args.clear)
    from common.hardware.target import gpu_available
    if not gpu_available():
        print(NO_GPU)
        return 0
    directory, writable = kernel_cache.usable_dir()
    if directory is None or not writable:
        where = kernel_cache.cache_dir()
        state = "is off" if where is None else f"at {where} cannot be written"
        print(f"The kernel cache {state}: nothing compiled now would be kept. Unset "
              f"{kernel_cache.ENV} (the default: ~/.cache/flash-numba) or set it to a writable "
              f"directory.")
        return 1
    units, skipped = configurations(args)
    for line in skipped:
        print(line)
    if not units:
        print("nothing to precompile")
        return 0
    return run_all(units, args.jobs or len(units), directory, kernel_cache)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m variants.precompile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=DEFAULTS["variants"], help="comma-separated")
    p.add_argument("--head-dims", default=DEFAULTS["head_dims"], help="comma-separated")
    p.add_argument("--dtypes", default=DEFAULTS["dtypes"], help="bfloat16 and/or float16")
    p.add_argument("--causal", default=DEFAULTS["causal"], choices=("both", "true", "false"))
    p.add_argument("--passes", default=DEFAULTS["passes"], help="fwd and/or bwd")
    p.add_argument("--jobs", type=int, default=0,
                   help="processes (default: one a configuration, at most one a CPU core)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--info", action="store_true", help="the cache's path, entries and size")
    action.add_argument("--clear", action="store_true", help="remove the cache's files")
    args = p.parse_args(argv)
    args.variants, args.dtypes, args.passes = (_names(getattr(args, n)) for n in
                                               ("variants", "dtypes", "passes"))
    try:
        args.head_dims = tuple(int(d) for d in _names(args.head_dims))
    except ValueError:
        p.error(f"--head-dims takes integers, got {args.head_dims!r}")
    for name, given, allowed in (("--dtypes", args.dtypes, DTYPE_NAMES),
                                 ("--passes", args.passes, PASSES)):
        wrong = [g for g in given if g not in allowed]
        if wrong:
            p.error(f"{name}: {', '.join(wrong)} not among {', '.join(allowed)}")
    from variants.registry import REGISTRY
    wrong = [v for v in args.variants if v not in REGISTRY]
    if wrong:
        p.error(f"--variants: {', '.join(wrong)} not registered ({', '.join(REGISTRY)})")
    if args.jobs < 0:
        p.error("--jobs must be positive")
    return args


def _names(text):
    return tuple(x.strip() for x in text.split(",") if x.strip())


def show_or_clear(kernel_cache, clear):
    """--info and --clear (no GPU needed)."""
    directory = kernel_cache.cache_dir()
    if directory is None:
        print(f"kernel cache: off ({kernel_cache.ENV}={os.environ.get(kernel_cache.ENV)!r})")
        return 0
    if clear:
        n, size = kernel_cache.clear(directory)
        print(f"removed {n} entries ({size / kernel_cache.MB:.1f} MB) from {directory}")
        return 0
    found = kernel_cache.info(directory)
    print(f"kernel cache: {directory}")
    print(f"entries: {found['entries']}")
    mb = kernel_cache.MB
    print(f"size: {found['bytes'] / mb:.1f} MB (limit {found['limit'] / mb:g} MB)")
    return 0


def configurations(args):
    """The (variant, pass, head_dim, dtype, causal) to compile, longest first (fa3, backward), and
    lines saying what is left out (fa3 off Hopper, head dims or passes a variant lacks)."""
    from numba import cuda

    from variants.registry import get
    cc = tuple(cuda.list_devices()[0].compute_capability)
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    units, skipped = [], []
    for variant in args.variants:
        if variant == "fa3" and cc != (9, 0):
            skipped.append(f"fa3: skipped (its kernels need sm_90; this GPU is sm_{cc[0]}{cc[1]})")
            continue
        module = get(variant)
        dims = [d for d in args.head_dims if d in getattr(module, "HEAD_DIMS", args.head_dims)]
        if len(dims) < len(args.head_dims):
            skipped.append(f"{variant}: head dims {sorted(set(args.head_dims) - set(dims))} "
                           "skipped (not among its HEAD_DIMS)")
        passes = [p for p in args.passes if p == "fwd" or hasattr(module, "backward")]
        if len(passes) < len(args.passes):
            skipped.append(f"{variant}: no backward pass")
        units += [(variant, p, d, t, c) for p in passes for d in dims for t in args.dtypes
                  for c in causal]
    units.sort(key=lambda u: (u[0] != "fa3", u[1] != "bwd"))
    return units, skipped


def describe(unit):
    variant, pass_, head_dim, dtype, causal = unit
    return f"{variant:<8} {pass_} d={head_dim:<3} {dtype:<8} causal={causal!s:<5}"


def run_all(units, jobs, directory, kernel_cache):
    """Run the configurations in `jobs` spawned processes; one line each as it finishes, then the
    total. Returns 1 when one failed."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    jobs = max(1, min(jobs, len(units), multiprocessing.cpu_count()))
    print(f"precompiling {len(units)} configurations in {jobs} processes into {directory}",
          flush=True)
    start, summed, failed = time.perf_counter(), 0.0, 0
    # by its module's name (not __main__'s) for the spawned processes to import
    from variants.precompile import compile_configuration as work
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(work, *u): u for u in units}
        for done in as_completed(futures):
            unit = futures[done]
            try:
                seconds = done.result()
            except Exception as e:   # reported, and the others go on
                failed += 1
                print(f"{describe(unit)}  FAILED: {type(e).__name__}: {e}", flush=True)
                continue
            summed += seconds
            print(f"{describe(unit)} {seconds:8.1f} s", flush=True)
    found = kernel_cache.info(directory)
    print(f"total: {len(units) - failed} of {len(units)} configurations in "
          f"{time.perf_counter() - start:.1f} s ({summed:.1f} s in the calls, {jobs} processes); "
          f"cache {directory}: {found['entries']} entries, "
          f"{found['bytes'] / kernel_cache.MB:.1f} MB")
    return 1 if failed else 0


def compile_configuration(variant, pass_, head_dim, dtype, causal, seqlen=SEQLEN):
    """One configuration's call, in a worker process: its seconds (the kernels compiled, or loaded
    from the cache, and run once). `seqlen`: the tests' smaller problem for the simulator."""
    common.select_backend()
    import numpy as np
    from numba import cuda

    from common.host.arrays import DTYPES, to_device
    from variants import registry
    rng = np.random.default_rng(0)
    shape = (BATCH, seqlen, HEADS, head_dim)

    q, k, v, o, do = (to_device(rng.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype]),
                                "numba") for _ in range(5))
    start = time.perf_counter()
    if pass_ == "fwd":
        registry.forward(q, k, v, variant=variant, causal=causal)
    else:   # o and lse of the right types and layouts (the values do not matter to the compile)
        lse = to_device(np.full((BATCH, HEADS, seqlen), np.log(seqlen), np.float32), "numba")
        registry.backward(do, q, k, v, o, lse, variant=variant, causal=causal)
    cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
