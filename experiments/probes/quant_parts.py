"""(Probe.) Where `fp8.py speed`'s "quant" column goes: each quantisation of one (4, 4096, 16, 128)
bf16 tensor alone, timed as a CUDA graph of 10 calls (GPU time only), in interleaved rounds, beside
a torch copy of the same tensor (the bandwidth it could run at). GPU host, torch.

    python experiments/probes/quant_parts.py"""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.hardware import elements
from common.host import arrays
from common.host.problem import _BSHD_TO_BHSD  # noqa: E402
from experiments.measure import inputs, timing  # noqa: E402
from variants import fp8

REPS = 10
b, n, h, d = 4, 4096, 16, 128
x = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
signs = inputs.to_device(fp8.random_signs(d, 0), "torch")
x32 = arrays.bits_view(arrays.describe(x), np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2)
amax = torch.zeros(1, device="cuda")
descale = torch.empty(b, h, 1, device="cuda")


def amax_pass():   # the per-tensor quantisers' first launch alone
    fp8.launch(fp8._quantizer(d, elements.BFLOAT16, False, "amax"), (n // 256, h, b), fp8.THREADS,
               0, arrays.stream_of(arrays.describe(x)), x32, arrays.placeholder("torch", 1, x), x32,
               arrays.bits_view(arrays.describe(descale), np.float32),
               arrays.bits_view(arrays.describe(amax), np.float32), np.int32(n), np.int32(256))


parts = {
    "copy (x.clone())": (lambda: x.clone(), 4),
    "amax pass (per tensor, step 1)": (amax_pass, 2),
    "block 256 + Hadamard (Q, K)": (lambda: fp8.quantize_fp8(x, block=256, signs=signs), 3),
    "block 256": (lambda: fp8.quantize_fp8(x, block=256), 3),
    "tensor (V)": (lambda: fp8.quantize_fp8(x, block=None), 5),
    "tensor, K-major (V^T)": (lambda: fp8.quantize_fp8(x, block=None, k_major=True), 5),
    "block = seqlen, K-major": (lambda: fp8.quantize_fp8(x, block=n, k_major=True), 5),
    "v_k_major of e4m3 V": (lambda v8=fp8.quantize_fp8(x, block=None)[0]: fp8.v_k_major(v8), 2),
}
graphs = [timing.capture_cuda_graph(lambda f=f: [f() for _ in range(REPS)]) for f, _ in parts.values()]
rounds = timing.interleaved([lambda i, g=g: g.replay() for g, _ in graphs], rounds=5, target_ms=40)
# bytes moved, in units of the fp8 tensor's size (x is 2 of them): a copy reads 2, writes 2; a
# one-pass quantiser reads 2, writes 1; the two-pass ones read 4
size = b * n * h * d
print(f"{'part':32} {'us':>8} {'GB/s (bytes it must move)':>26}")
for (name, (_, units)), r in zip(parts.items(), rounds):
    us = statistics.median(t.median_ms for t in r) * 1e3 / REPS
    print(f"{name:32} {us:8.1f} {units * size / us / 1e3:12.0f}", flush=True)
