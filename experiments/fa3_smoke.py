"""One fa3 forward per head_dim and causal setting against float64 (a first look on a fresh GPU
host, seconds; also a small target for compute-sanitizer):

    python experiments/fa3_smoke.py [seqlen] ['{"pingpong": false}'] [head_dims, e.g. 64,128]
"""
import json
import sys

import numpy as np

import common

common.select_backend()
import variants  # noqa: E402
from common import checks, inputs, reference  # noqa: E402

seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 700
options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
head_dims = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else (64, 128)
rng = np.random.default_rng(0)
ok = True
for head_dim in head_dims:
    for causal in (False, True):
        q, k, v = inputs.random_qkv(rng, 2, seqlen, 2, head_dim, "bfloat16")
        dq, dk, dv = (inputs.to_device(x, "cupy") for x in (q, k, v))
        o, lse = variants.forward(dq, dk, dv, variant="fa3", causal=causal, **options)
        got = checks.compare(inputs.to_host(o), inputs.to_host(lse),
                             *reference.attention(q, k, v, causal=causal), "bfloat16")
        print(f"fa3 d={head_dim} causal={causal} {options}: {got}", flush=True)
        ok &= got["ok"]
sys.exit(0 if ok else 1)
