"""One fa3 forward per head_dim against float64 (a first look on a fresh GPU host, seconds)."""
import sys

import numpy as np

import common

common.select_backend()
import variants  # noqa: E402
from common import checks, inputs, reference  # noqa: E402

rng = np.random.default_rng(0)
ok = True
for head_dim in (64, 128):
    for causal in (False, True):
        q, k, v = inputs.random_qkv(rng, 2, 700, 2, head_dim, "bfloat16")
        dq, dk, dv = (inputs.to_device(x, "cupy") for x in (q, k, v))
        o, lse = variants.forward(dq, dk, dv, variant="fa3", causal=causal)
        got = checks.compare(inputs.to_host(o), inputs.to_host(lse),
                             *reference.attention(q, k, v, causal=causal), "bfloat16")
        print(f"fa3 d={head_dim} causal={causal}: {got}", flush=True)
        ok &= got["ok"]
sys.exit(0 if ok else 1)
