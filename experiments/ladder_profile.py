"""Every rung of the FA1 -> FA2 ladder launched twice (a warm-up, then the one to read) on the same
bf16 tensors of the FA2 paper's shape, for a profiler:

    ncu --clock-control none -k regex:"fa1_forward|fa2_forward" --csv --metrics <...> \
        python3 experiments/ladder_profile.py <head_dim> <seqlen> <causal 0|1>

(docs/results/ladder_ncu_h200.txt lists the metrics read for docs/performance/ladder.md and
io_model.md.)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

common.select_backend()

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import variants  # noqa: E402
from experiments.measure import inputs  # noqa: E402

RUNGS = [("fa1", {}), ("fa1", dict(q_splits=0)), ("fa1", dict(outer_loop="q")),
         ("fa1", dict(outer_loop="q", deferred_rescale=True)), ("fa2", dict(causal_skip=False)),
         ("fa2", {})]   # conf/ladder/r0 ... r5


def main(head_dim, seqlen, causal):
    rng = np.random.default_rng(0)
    qkv = [inputs.to_device(x, inputs.default_library()) for x in
           inputs.random_qkv(rng, 16384 // seqlen, seqlen, 2048 // head_dim, head_dim, "bfloat16")]
    for name, options in RUNGS:
        for _ in range(2):
            variants.forward(*qkv, variant=name, causal=causal, **options)
        cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
