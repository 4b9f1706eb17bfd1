"""(Probe, as it ran on the GPU host (its timing loop and problem now shared with host_overhead.py): python experiments/probes/custom_op_cost.py from the repository root.)
Host time of the custom operators against the direct calls; where a compiled GPT step's host
time goes (torch.profiler), fa2 against sdpa_flash."""
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import torch  # noqa: E402

import variants  # noqa: E402
from common.hardware import target  # noqa: E402
from experiments import gpt_step  # noqa: E402
from experiments.host_overhead import per_call_us, small_problem  # noqa: E402
from variants import torch_ops  # noqa: E402

q, k, v, do = small_problem()
m = variants.get("fa2")
o, lse = m.forward(q, k, v, causal=True)
args = ("fa2", True, None, -1, -1, 0.0, "bottom_right", "", "")
op_f, op_b = torch.ops.flash_numba.forward.default, torch.ops.flash_numba.backward.default
rows = [
    ("direct forward", per_call_us(lambda: m.forward(q, k, v, causal=True))),
    ("op forward (torch.ops)", per_call_us(lambda: op_f(q, k, v, *args))),
    ("custom_op forward (python obj)", per_call_us(lambda: torch_ops.forward(q, k, v, *args))),
    ("direct backward", per_call_us(lambda: m.backward(do, q, k, v, o, lse, causal=True))),
    ("op backward (torch.ops)", per_call_us(lambda: op_b(do, q, k, v, o, lse, *args[:-1]))),
]
sd = torch.ops.aten._scaled_dot_product_flash_attention.default
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
rows.append(("aten sdpa flash forward op", per_call_us(lambda: sd(qt, kt, vt, 0.0, True))))
with torch.no_grad():
    rows.append(("op forward, no_grad", per_call_us(lambda: op_f(q, k, v, *args))))
for name, us in rows:
    print(f"{name:34s} {us:8.1f}", flush=True)

# a compiled GPT step under torch.profiler
shape = dict(layers=4, width=512, heads=8, vocab=8192, seqlen=1024)
for name in ("sdpa_flash", "fa2"):
    torch.manual_seed(0)
    model = torch.compile(gpt_step.make_model(torch, gpt_step.attention_fn(name), **shape).cuda(),
                          fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(0, 8192, (8, 1025), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    print(f"## {name} compiled: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms/step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
print(f"# {target.describe()}, torch {torch.__version__}")
