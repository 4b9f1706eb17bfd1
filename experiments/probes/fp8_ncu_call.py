"""(Probe: the process that `docs/results/fp8_causal_ncu_h100.txt` profiled.) One fa3 FP8 forward
(d=128, the FA2 paper's shape: batch x seqlen = 16k, 16 heads; one scale a head, V^T by the
pre-pass) between cudaProfilerStart and Stop, after three warm-up calls, for

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \\
        python experiments/probes/fp8_ncu_call.py SEQLEN CAUSAL(0|1) ['{"option": value}']

GPU host, torch."""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import numpy as np  # noqa: E402
import torch  # noqa: E402

import variants  # noqa: E402
from experiments.measure import inputs  # noqa: E402
from variants import fp8

n, causal = int(sys.argv[1]), sys.argv[2] == "1"
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
b, h, d = max(1, 16384 // n), 16, 128
q, k, v = (inputs.to_device(x, "torch") for x in
           inputs.random_qkv(np.random.default_rng(0), b, n, h, d, "bfloat16"))
(q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_fp8(x, block=None) for x in (q, k, v))


def call():
    return variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd,
                            k_descale=kd, v_descale=vd, **options)


for _ in range(3):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
