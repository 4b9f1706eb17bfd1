"""(Probe, as it ran on the GPU host (its timing loop and problem now shared with host_overhead.py): python experiments/probes/autograd_thread.py from the repository root.)
Where the autograd path's host time goes (issue 18). GPU host, torch."""
import collections
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
from experiments.host_overhead import per_call_us, small_problem  # noqa: E402
from variants import backward_shared as cbwd  # noqa: E402
from variants import fa2_backward  # noqa: E402


def on_thread(fn):
    res = {}
    t = threading.Thread(target=lambda: res.setdefault("us", per_call_us(fn)))
    t.start()
    t.join()
    return res["us"]


q, k, v, do = small_problem()
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
m = variants.get("fa2")
o, lse = m.forward(q, k, v)
fwd = lambda: m.forward(q, k, v)  # noqa: E731
bwd = lambda: m.backward(do, q, k, v, o, lse)  # noqa: E731
both = lambda: torch.autograd.grad(variants.attention(*leaves, variant="fa2"), leaves, do)  # noqa


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return g, torch.empty_like(k), torch.empty_like(v)


ident = lambda: torch.autograd.grad(Ident.apply(*leaves), leaves, do)  # noqa: E731
rows = []
rows.append(("fa2 forward direct", per_call_us(fwd)))
rows.append(("fa2 backward direct", per_call_us(bwd)))
rows.append(("fa2 backward, python thread", on_thread(bwd)))
rows.append(("fa2 forward, python thread", on_thread(fwd)))
rows.append(("fa2 autograd MT", per_call_us(both)))
rows.append(("identity Function autograd MT", per_call_us(ident)))
with torch.autograd.set_multithreading_enabled(False):
    rows.append(("fa2 autograd single-thread", per_call_us(both)))
    rows.append(("identity Function single-thread", per_call_us(ident)))
sd = lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
    *(x.transpose(1, 2) for x in leaves)), leaves, do.transpose(1, 2))
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    rows.append(("sdpa_flash autograd MT", per_call_us(sd)))

# instrumentation ------------------------------------------------------------------------
stats = collections.defaultdict(lambda: [0.0, 0])
entry_ctx = collections.Counter()


def timed(name, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            s = stats[(threading.current_thread().name[:12], name)]
            s[0] += time.perf_counter() - t0
            s[1] += 1
    return wrapper


orig_backward = variants.backward


def backward_probe(*a, **kw):
    entry_ctx[(threading.get_ident(), getattr(launching._thread, "has_context", False))] += 1
    return orig_backward(*a, **kw)


variants.backward = timed("variants.backward", backward_probe)
cbwd.prepare_backward = timed("prepare_backward", cbwd.prepare_backward)
fa2_backward.run_backward = timed("run_backward", fa2_backward.run_backward)
fa2_backward.default_backward_config = timed("default_backward_config",
                                             fa2_backward.default_backward_config)
cbwd.preprocess = timed("preprocess", cbwd.preprocess)
cbwd.convert_dq = timed("convert_dq", cbwd.convert_dq)
for mod in (fa2_backward, cbwd):
    mod.launch = timed("launch", mod.launch)
launching._Launcher._buffer = timed("_Launcher._buffer", launching._Launcher._buffer)
from numba import cuda  # noqa: E402

cuda.current_context = timed("cuda.current_context", cuda.current_context)
orig_fwd = m.forward
m.forward = timed("fa2.forward", orig_fwd)


def report(title):
    print(f"## {title}")
    for (th, name), (t, n) in sorted(stats.items()):
        print(f"  {th:12s} {name:26s} calls {n:5d}  {t / max(n, 1) * 1e6:8.1f} us/call")
    print("  backward entries (thread ident, has_context):", dict(entry_ctx))
    stats.clear()
    entry_ctx.clear()


for _ in range(50):
    bwd()
torch.cuda.synchronize()
report("direct backward x50 (plus warm)")
for _ in range(50):
    both()
torch.cuda.synchronize()
report("autograd MT x50")
with torch.autograd.set_multithreading_enabled(False):
    for _ in range(50):
        both()
    torch.cuda.synchronize()
report("autograd single-thread x50")

# sampling profiler over the autograd MT loop -------------------------------------------
samples = collections.Counter()
leafs = collections.Counter()
main_id = threading.get_ident()
stop = threading.Event()


def sampler():
    me = threading.get_ident()
    while not stop.is_set():
        for tid, frame in sys._current_frames().items():
            if tid in (me, main_id):
                continue
            stack = []
            f = frame
            while f is not None and len(stack) < 12:
                stack.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}")
                f = f.f_back
            leafs[stack[0]] += 1
            samples[" < ".join(stack[:5])] += 1
        time.sleep(0.0001)


th = threading.Thread(target=sampler, name="sampler")
th.start()
for _ in range(300):
    both()
torch.cuda.synchronize()
stop.set()
th.join()
print("## sampled leaf frames on non-main threads (autograd MT x300)")
for s, n in leafs.most_common(25):
    print(f"  {n:6d}  {s}")
print("## sampled stacks")
for s, n in samples.most_common(25):
    print(f"  {n:6d}  {s}")

# cProfile of the single-thread autograd path --------------------------------------------
import cProfile  # noqa: E402
import pstats  # noqa: E402

variants.backward, m.forward = orig_backward, orig_fwd
with torch.autograd.set_multithreading_enabled(False):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        both()
    torch.cuda.synchronize()
    pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
print(f"# {target.describe()}, torch {torch.__version__}")
print("## per call, us")
for name, us in rows:
    print(f"{name:34s} {us:8.1f}")
