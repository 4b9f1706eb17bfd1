"""(Probe: python experiments/probes/first_call_profile.py [OUTDIR] from the repository root, GPU host,
torch.) Where a new process's WARM-cache first call of fa3 forward + backward goes (B=2, N=2048,
16 heads of 128, causal, bf16, the shapes of experiments/first_call.py).

1. fill: one child, experiments/first_call.py's CHILD (fa3 fwd_bwd, 2 calls), fills a fresh
   kernel cache (FA_KERNEL_CACHE=/tmp/kcache-profile-*);
2. children with no profiler, each: import, the first call (forward and backward timed apart,
   the main thread's CPU time beside its wall time), calls 2 and 3, and inclusive timers wrapped
   around the host-side steps (kernel_cache, launching, fa3.build, fa3_backward.build_backward,
   tensormaps): `plain` as a user's process runs it; `plain` with FA_REPLAY=0 (no replay, so no
   thread importing torch._dynamo beside the call: common/host/replay.py _dispatch_ready);
   `plain+prewarm`: replay.warm_up() (that import, timed) before the first call;
3. `profile` and `profile+prewarm`: a child under cProfile: the import (its own profile) and the
   first call alone (a Profile enabled around it), autograd's multithreading off so that the
   backward runs on the profiled thread; prints the top 40 by cumulative time and the top 25 by
   tottime, the repository's functions and the callers of the host-side steps, and keeps the stats
   (pstats file and JSON) in OUTDIR/<mode>_replay<0|1>/."""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
from experiments.first_call import CHILD  # noqa: E402

COMMON = r"""
import json, os, sys, time
t0 = time.perf_counter()
MODE, OUTDIR = sys.argv[1], sys.argv[2]
PROFILE = MODE.startswith("profile")
PREWARM = "prewarm" in MODE
if PROFILE:
    import cProfile, io, pstats
    prof_import = cProfile.Profile()
    prof_import.enable()
import torch
import variants
if PROFILE:
    prof_import.disable()
t_import = time.perf_counter() - t0

timers = {}
def wrap(module, name):
    import importlib
    mod = importlib.import_module(module)
    owner, attr = mod, name
    if "." in name:
        cls, attr = name.split(".")
        owner = getattr(mod, cls)
    fn = getattr(owner, attr, None)
    if fn is None:
        return
    label = f"{module}.{name}"
    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            s = timers.setdefault(label, [0, 0.0])
            s[0] += 1
            s[1] += time.perf_counter() - t
    setattr(owner, attr, timed)

if not PROFILE:
    for module, name in [
            ("common.host.kernel_cache", "load_or_compile"), ("common.host.kernel_cache", "cache_key"),
            ("common.host.kernel_cache", "toolchain_version"), ("common.host.kernel_cache", "source_digest"),
            ("common.host.kernel_cache", "source_modules"), ("common.host.kernel_cache", "load"),
            ("common.host.kernel_cache", "module_function"), ("common.host.kernel_cache", "usable_dir"),
            ("common.host.kernel_cache", "device_compute_capability"),
            ("common.host.kernel_cache", "compile_function"),
            ("common.host.launching", "_Launcher.__init__"),
            ("common.host.tensormaps", "tensor_maps"),
            ("variants.fa3", "build"), ("variants.fa3", "_run"), ("variants.fa3", "forward"),
            ("variants.fa3", "backward"), ("variants.fa3_backward", "build_backward"),
            ("variants.fa3_backward", "backward"), ("variants.registry", "forward"),
            ("variants.registry", "backward")]:
        try:
            wrap(module, name)
        except Exception as e:
            print("could not wrap", module, name, e)

q, k, v = (torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
torch.cuda.synchronize()
t_setup = time.perf_counter() - t0 - t_import
t_prewarm = None
if PREWARM:   # the torch._dynamo import that replay's first call starts on a thread, done first
    from common.host import replay
    t = time.perf_counter()
    replay.warm_up()
    t_prewarm = time.perf_counter() - t

def one_call(split=False):
    t = time.perf_counter()
    o = variants.attention(q, k, v, variant="fa3", causal=True)
    if split:
        torch.cuda.synchronize()
        t_f = time.perf_counter() - t
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    return (total, t_f) if split else total

if PROFILE:
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        t = time.perf_counter()
        prof.enable()
        first = one_call()
        prof.disable()
        first_wall = time.perf_counter() - t
    first_fwd = None
else:
    cpu0 = time.thread_time()
    first, first_fwd = one_call(split=True)
    first_cpu = time.thread_time() - cpu0
from common.host import replay as _replay
alive_after_first = bool(_replay._first_use is not None and _replay._first_use.is_alive())
later = [one_call() for _ in range(2)]
res = {"mode": MODE, "replay": _replay.ENABLED, "prewarm": t_prewarm,
       "first_cpu_main_thread": None if PROFILE else first_cpu,
       "dynamo_imported": "torch._dynamo" in sys.modules,
       "first_use_thread_alive": bool(_replay._first_use is not None and _replay._first_use.is_alive()),
       "alive_after_first": alive_after_first, "import": t_import, "setup": t_setup, "first": first, "first_fwd": first_fwd,
       "later": later, "timers": timers}
if PROFILE:
    for name, p in (("first_call", prof), ("import", prof_import)):
        p.dump_stats(os.path.join(OUTDIR, f"{name}.prof"))
        st = pstats.Stats(p)
        rows = [["%s:%d(%s)" % key, cc, nc, tt, ct,
                 {"%s:%d(%s)" % c: list(v) for c, v in callers.items()}]
                for key, (cc, nc, tt, ct, callers) in st.stats.items()]
        with open(os.path.join(OUTDIR, f"{name}_stats.json"), "w") as f:
            json.dump(rows, f)
    for title, p, sort, n in (("FIRST CALL: top 40 by cumulative", prof, "cumulative", 40),
                              ("FIRST CALL: top 25 by tottime", prof, "tottime", 25),
                              ("FIRST CALL: repo functions (common/, variants/) by cumulative", prof,
                               "cumulative", r"/(common|variants)/.*\.py.*", ),
                              ("IMPORT: top 30 by cumulative", prof_import, "cumulative", 30)):
        s = io.StringIO()
        st = pstats.Stats(p, stream=s).sort_stats(sort)
        if isinstance(n, str):
            st.print_stats(n, 50)
        else:
            st.print_stats(n)
        print("=" * 30, title)
        print(s.getvalue())
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).sort_stats("cumulative")
    st.print_callers(r"load_or_compile|module_function|cache_key|toolchain_version|source_digest|"
                     r"create_module_image|build_backward|\(build\)|tensor_maps|_Launcher", 20)
    print("=" * 30, "FIRST CALL: callers of the host-side steps")
    print(s.getvalue())
    res["first_wall_profiled"] = first_wall
print("RESULT " + json.dumps(res))
"""


def child(args, env, timeout):
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    wall = time.perf_counter() - t
    if out.returncode:
        print(f"child exit {out.returncode}: {out.stdout[-3000:]} {out.stderr[-5000:]}")
    return out, wall


def main():
    outdir = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    os.makedirs(outdir, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="kcache-profile-", dir="/tmp")
    env = dict(os.environ, FA_KERNEL_CACHE=cache, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([os.getcwd()] + os.environ.get("PYTHONPATH", "").split(
                   os.pathsep)))
    print(f"cache {cache}, out {outdir}, python {sys.version.split()[0]}", flush=True)
    out, wall = child([CHILD, "fa3", "fwd_bwd", "2"], env, 400)
    print(f"fill (cold, first_call.py CHILD, fa3 fwd_bwd, 2 calls): wall {wall:.1f} s, "
          f"{out.stdout.strip().splitlines()[-1] if out.stdout.strip() else '-'}", flush=True)
    files = sorted(os.listdir(cache))
    print(f"cache holds {len(files)} files, {sum(os.path.getsize(os.path.join(cache, f)) for f in files) / 1e6:.1f} MB:",
          " ".join(f for f in files if f.endswith(".entry")), flush=True)
    for mode, replay in (("plain", "1"), ("plain", "0"), ("plain+prewarm", "1"), ("profile", "1"),
                         ("profile+prewarm", "1")):
        d = os.path.join(outdir, f"{mode.replace('+', '_')}_replay{replay}")
        os.makedirs(d, exist_ok=True)
        out, wall = child([COMMON, mode, d], dict(env, FA_REPLAY=replay), 150)
        mode = f"{mode} FA_REPLAY={replay}"
        with open(os.path.join(d, "child.log"), "w") as f:
            f.write(out.stdout + "\n--- stderr\n" + out.stderr)
        lines = out.stdout.strip().splitlines()
        res = json.loads(lines[-1][len("RESULT "):]) if lines and lines[-1].startswith("RESULT ") else None
        print(f"\n######## {mode} child: wall {wall:.1f} s", flush=True)
        if mode.startswith("profile"):
            print("\n".join(lines[:-1]))
        if res:
            print(f"{mode}: dynamo imported by the end: {res['dynamo_imported']}, its thread running after "
                  f"the first call: {res['alive_after_first']}, after call 3: {res['first_use_thread_alive']}, warm_up() beforehand: {res['prewarm']}, "
                  f"main thread CPU in the first call: {res['first_cpu_main_thread']}")
            print(f"{mode}: import {res['import']:.2f} s, tensors {res['setup']:.2f} s, "
                  f"first call {res['first']:.3f} s"
                  + (f" (forward {res['first_fwd']:.3f} s)" if res['first_fwd'] is not None else "")
                  + f", calls 2 and 3 {res['later'][0]:.4f} s {res['later'][1]:.4f} s")
            for label, (n, s) in sorted(res["timers"].items(), key=lambda kv: -kv[1][1]):
                print(f"  {label:55s} {n:4d} calls {s:8.3f} s")
        print(f"stderr tail: {out.stderr[-1500:]}" if out.stderr.strip() else "", flush=True)


if __name__ == "__main__":
    main()
