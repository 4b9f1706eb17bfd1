"""fa2's backward with each dQ path (dq="separate", dq="atomic") and, where torch sees a GPU, SDPA's
FlashAttention-2 backward, each launched `repeats` times (default 2: a warm-up, then the one to read)
on the same bf16 tensors of the FA2 paper's shape (batch * seqlen = 16k, hidden 2048), for a profiler
or a sanitizer:

    ncu --clock-control none -k regex:"fa2_backward|flash_bwd" --csv --metrics <...> \\
        python3 experiments/backward_profile.py <head_dim> <seqlen> <causal 0|1>
    compute-sanitizer --tool racecheck python3 experiments/backward_profile.py 64 256 1 1

(`experiments/gpu_check.sh bwd_ncu` runs the first with the metrics of docs/results/
ladder_ncu_h200.txt.) Runs in the simulator too (NUMBA_ENABLE_CUDASIM=1), slowly: keep it small.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

common.select_backend()

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import variants  # noqa: E402
from experiments import peers  # noqa: E402
from experiments.measure import inputs  # noqa: E402

DQ_PATHS = ("separate", "atomic")


def main(head_dim, seqlen, causal, repeats=2, batch=None, heads=None, **options):
    rng = np.random.default_rng(0)
    library = inputs.default_library()
    batch = batch or max(1, 16384 // seqlen)
    heads = heads or 2048 // head_dim
    host = inputs.random_qkv(rng, batch, seqlen, heads, head_dim, "bfloat16")
    host += (rng.standard_normal(host[0].shape, dtype=np.float32).astype(host[0].dtype),)
    q, k, v, do = (inputs.to_device(x, library) for x in host)
    o, lse = variants.forward(q, k, v, variant="fa2", causal=causal)
    grads = {}
    for dq in DQ_PATHS:
        for _ in range(repeats):
            grads[dq] = variants.backward(do, q, k, v, o, lse, variant="fa2", causal=causal, dq=dq,
                                          **options)
        cuda.synchronize()
    if library == "torch" and peers.available():
        import torch
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        forward = peers.forward_fn("sdpa_flash", causal, None, gqa=False)
        for _ in range(repeats):
            torch.autograd.grad(forward(*leaves), leaves, do)
        torch.cuda.synchronize()
    return grads


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1",
         *(int(a) for a in sys.argv[4:5]))
