"""fa3 in FP8 with V transposed by the producer warpgroup (transpose_v="producer") against the
pre-pass path, bit for bit, on the GPU; small, so that it is also a target for compute-sanitizer:

    python experiments/fp8_transpose_check.py [--seqlens 1100,520] [--sms 3]
    compute-sanitizer --tool racecheck --racecheck-report hazard \\
        python experiments/fp8_transpose_check.py --sms 3
    compute-sanitizer --tool synccheck python experiments/fp8_transpose_check.py --sms 3

--sms N launches the persistent grid as if the GPU had N SMs, so that each block loops over
several tiles (the staging buffers' and the V^T ring's phases carried from tile to tile).
Exits 1 if any output differs.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common

common.select_backend()
import variants  # noqa: E402
from experiments.fa3_smoke import add_sms_option, cap_grid  # noqa: E402
from experiments.measure import inputs  # noqa: E402
from variants import fp8


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="1100,520")
    ap.add_argument("--heads", type=int, default=2)
    add_sms_option(ap)
    args = ap.parse_args(argv)
    cap_grid(args)
    import torch
    rng = np.random.default_rng(0)
    ok = True
    for n in map(int, args.seqlens.split(",")):
        for causal in (False, True):
            q, k, v = (inputs.to_device(x, "torch")
                       for x in inputs.random_qkv(rng, 1, n, args.heads, 128, "bfloat16"))
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_fp8(x, block=None) for x in (q, k, v))
            (o0, l0), (o1, l1) = (variants.forward(q8, k8, v8, variant="fa3", causal=causal,
                                                   q_descale=qd, k_descale=kd, v_descale=vd,
                                                   transpose_v=mode)
                                  for mode in ("prepass", "producer"))
            same = torch.equal(o0.view(torch.int16), o1.view(torch.int16)) and torch.equal(l0, l1)
            ok &= same
            print(f"d=128 n={n} causal={causal}: producer == prepass bit for bit: {same}",
                  flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
