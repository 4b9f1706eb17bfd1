"""Host time per call: fa2.forward, its argument checks and allocation alone (`prepare`), and torch
SDPA's flash backend, on a problem too small for the GPU to matter (128 blocks of one K/V step).

    python experiments/host_overhead.py        (GPU host, torch installed)
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.select_backend()


def per_call_us(fn, calls=300):
    import torch
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    import numpy as np

    from common import inputs
    from common.problem import prepare
    from experiments import peers
    from variants import fa2

    q = inputs.to_device(inputs.random_qkv(np.random.default_rng(0), 1, 64, 128, 64, "bfloat16")[0],
                         "torch")
    sdpa = peers.forward_fn("sdpa_flash", False, None, False)
    for name, fn in [("fa2.forward", lambda: fa2.forward(q, q, q)),
                     ("prepare only", lambda: prepare(q, q, q, causal=False, softmax_scale=None,
                                                      out=None, head_dims=fa2.HEAD_DIMS, variant="fa2")),
                     ("sdpa_flash", lambda: sdpa(q, q, q))]:
        print(f"host time per call, {name}: {per_call_us(fn):.1f} us")


if __name__ == "__main__":
    main()
