"""A compute-sanitizer target for fa2's backward: both dQ paths (atomic in bf16, separate in fp16),
head_dim 64 and 128, causal, a ragged length and two query heads sharing one K/V head (GQA), so
that every shared-memory hand-off of the K/V kernel (Q_i/dO_i stages, L_i/D_i, the staged dS^T and
the dQ product that reads it) and of the dQ kernel runs at least twice:

    compute-sanitizer --tool racecheck --racecheck-report hazard python3 experiments/backward_racecheck.py
    compute-sanitizer --tool synccheck python3 experiments/backward_racecheck.py [seqlen]

(seqlen defaults to 300). Needs cupy on a GPU; in the simulator (NUMBA_ENABLE_CUDASIM=1) it runs on
Numba arrays, slowly: pass a small seqlen.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

MODE = common.select_backend()

import numpy as np  # noqa: E402

import variants  # noqa: E402
from experiments.measure import inputs  # noqa: E402


def main(seqlen=300):
    rng = np.random.default_rng(1)
    library = "cupy" if MODE == "gpu" else "numba"
    for head_dim in (64, 128):
        for dtype, dq in (("bfloat16", "atomic"), ("float16", "separate")):
            host = inputs.random_qkv(rng, 1, seqlen, 2, head_dim, dtype, heads_kv=1) \
                + inputs.random_qkv(rng, 1, seqlen, 2, head_dim, dtype)[:1]
            q, k, v, do = (inputs.to_device(x, library) for x in host)
            o, lse = variants.forward(q, k, v, variant="fa2", causal=True)
            variants.backward(do, q, k, v, o, lse, variant="fa2", causal=True, dq=dq)
            print("ran", head_dim, dtype, dq, flush=True)


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:]))
