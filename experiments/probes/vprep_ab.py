"""(Probe: `docs/results/fp8_vprep_loads_h100.txt`.) V's K-major pre-pass of an older variants/fp8.py
against the working tree's: bits compared, each timed as a CUDA graph of 20 launches (no host time
in the figure) in interleaved rounds, the median per launch.

    git show REV:variants/fp8.py > /tmp/fp8_old.py
    FA_KERNEL_CACHE= python experiments/probes/vprep_ab.py /tmp/fp8_old.py

(the kernel cache off, so that the two modules' kernels are compiled each from its own source).
GPU host, torch."""
import importlib.util
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import torch  # noqa: E402

from experiments.measure import timing  # noqa: E402
from variants import fp8

spec = importlib.util.spec_from_file_location("fp8_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
REPS = 20
print("shape (b, n, h, d)   old us   new us   new/old  old TB/s new TB/s   [per-round ratio range]")
for b, n, h, d in [(4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 8, 256), (2, 1000, 4, 128)]:
    v = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    v8, _ = fp8.quantize_fp8(v, block=None)
    # (since v_k_major returns an fp8.KMajorV, its V^T is .data; older revisions returned V^T)
    a, c = (getattr(x, "data", x) for x in (old.v_k_major(v8), fp8.v_k_major(v8)))
    same = torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    graphs = []
    for mod in (old, fp8):
        g, keep = timing.capture_cuda_graph(lambda mod=mod: [mod.v_k_major(v8) for _ in range(REPS)])
        graphs.append((g, keep))
    rounds = timing.interleaved([lambda i, g=g: g.replay() for g, _ in graphs], rounds=10,
                                target_ms=40)
    us = [[t.median_ms * 1e3 / REPS for t in r] for r in rounds]
    ratio = [y / x for x, y in zip(*us)]
    mo, mn = statistics.median(us[0]), statistics.median(us[1])
    nbytes = 2 * b * n * h * d
    print(f"{(b, n, h, d)!s:20} {mo:8.2f} {mn:8.2f} {statistics.median(ratio):9.3f} "
          f"{nbytes / mo / 1e6:8.2f} {nbytes / mn / 1e6:8.2f}   [{min(ratio):.3f}-{max(ratio):.3f}]"
          f"  bits {'same' if same else 'DIFFER'}", flush=True)
    if not same:
        sys.exit(1)
