"""(Probe, as it ran on the GPU host (its timing loop and problem now shared with host_overhead.py): python experiments/probes/thread_primitives.py from the repository root.)
Which primitives cost more off the main thread and inside torch's autograd device thread."""
import os
import sys
import threading
import time

sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import torch  # noqa: E402

import variants  # noqa: E402
from common.hardware import target  # noqa: E402
from common.host import launching  # noqa: E402
from experiments.host_overhead import small_problem  # noqa: E402
from variants import backward_shared as cbwd  # noqa: E402


def per_call_us(fn, calls=300, sync=True):
    for _ in range(20):
        fn()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def on_thread(fn, **kw):
    res = {}
    def body():
        launching.launch(*pre)   # makes the context current on this thread
        res["us"] = per_call_us(fn, **kw)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return res["us"]


print("affinity", sorted(os.sched_getaffinity(0)), "threads", threading.active_count())
q, k, v, do = small_problem()
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
m = variants.get("fa2")
o, lse = m.forward(q, k, v)
captured = []
orig_launch = cbwd.launch


def capture(*a):
    captured.append(a)
    return orig_launch(*a)


cbwd.launch = capture
m.backward(do, q, k, v, o, lse)
cbwd.launch = orig_launch
pre = captured[0]
launcher = [v_ for key, v_ in launching._compiled.items() if key[0] == id(pre[0])][0]
from cuda.bindings import driver as cu  # noqa: E402


def pure():
    d = {}
    for i in range(300):
        d[i] = i * 2
    return sum(d.values())


prims = {
    "pure python (300 dict ops)": (pure, False),
    "torch.empty (1,128,64,64) f32": (lambda: torch.empty((1, 128, 64, 64), device="cuda"), True),
    "cuCtxGetCurrent": (lambda: cu.cuCtxGetCurrent(), False),
    "launching.launch(preprocess)": (lambda: launching.launch(*pre), True),
    "_Launcher.__call__": (lambda: launcher(pre[1], pre[2], pre[3], pre[4], pre[5:]), True),
    "time.sleep(0)": (lambda: time.sleep(0), False),
}
rows = []
print(f"{'primitive':34s} {'main':>8s} {'thread':>8s}")
for name, (fn, sync) in prims.items():
    a, b = per_call_us(fn, 2000, sync), on_thread(fn, calls=2000, sync=sync)
    print(f"{name:34s} {a:8.2f} {b:8.2f}", flush=True)


def make(body):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return q.clone()

        @staticmethod
        def backward(ctx, g):
            body()
            return g, g, g
    return lambda: torch.autograd.grad(F.apply(*leaves), leaves, do)


bodies = {
    "identity (return g,g,g)": lambda: None,
    "+ torch.empty": lambda: torch.empty((1, 128, 64, 64), device="cuda"),
    "+ 1 launch": lambda: launching.launch(*pre),
    "+ 3 launches": lambda: (launching.launch(*pre), launching.launch(*pre), launching.launch(*pre)),
    "+ pure python": pure,
    "+ fa2 backward": lambda: m.backward(do, q, k, v, o, lse),
}
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sd = lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
    *(x.transpose(1, 2) for x in leaves)), leaves, do.transpose(1, 2))
print(f"{'autograd.Function backward':34s} {'MT':>8s} {'1 thread':>8s}")
for name, body in list(bodies.items()) + [("sdpa_flash (C++ node)", None)]:
    fn = make(body) if body else sd
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        a = per_call_us(fn)
        with torch.autograd.set_multithreading_enabled(False):
            b = per_call_us(fn)
    print(f"{name:34s} {a:8.1f} {b:8.1f}", flush=True)
print(f"# {target.describe()}, torch {torch.__version__}")
