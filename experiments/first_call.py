"""What a new process pays before attention runs at kernel speed: the import, the first call
(compiling, or loading cubins from the kernel cache), and the host time of the calls after it.

    python experiments/first_call.py [--variants fa2,fa3,sdpa] [--passes fwd,fwd_bwd] [--calls 5]

Each row is a fresh Python process (torch tensors B=2, N=2048, 16 heads of 128, causal, bf16, as
`variants.attention` in a training loop would see them), run twice over one kernel-cache folder:
`cold` (empty: everything compiles) then `warm` (the cubins the cold run stored). Times are wall
clock with the GPU synchronised after each call, so a call's time is its host time plus its
kernels'. `sdpa` is the baseline: torch's SDPA (its flash kernel) in the same fresh process, run
once (it keeps no cache): what torch itself costs a new process's first call (its first
`backward(grad)` imports torch.fx's symbolic shapes and sympy, whatever the attention), so that a
variant's own first-call cost is its time less sdpa's. Prints one table."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import variants
t_import = time.perf_counter() - t0
variant, passes, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
q, k, v = (torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))

def attention(q, k, v):
    if variant != "sdpa":
        return variants.attention(q, k, v, variant=variant, causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


times = []
for _ in range(calls):
    t = time.perf_counter()
    o = attention(q, k, v)
    if passes == "fwd_bwd":
        o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
print(json.dumps({"import": t_import, "calls": times}))
"""


def run(variant, passes, calls, cache):
    env = dict(os.environ, FA_KERNEL_CACHE=cache, PYTHONPATH=os.pathsep.join(
        [os.getcwd()] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    out = subprocess.run([sys.executable, "-c", CHILD, variant, passes, str(calls)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"exit {out.returncode}: {out.stdout[-1000:]} {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="fa2,fa3,sdpa")
    parser.add_argument("--passes", default="fwd,fwd_bwd")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for variant in args.variants.split(","):
        for passes in args.passes.split(","):
            with tempfile.TemporaryDirectory(prefix="kcache-") as cache:
                for state in (("cold", "warm") if variant != "sdpa" else ("-",)):
                    r = run(variant, passes, args.calls, cache)
                    rows.append((variant, passes, state, r["import"], r["calls"]))
    print(f"{'variant':8s} {'pass':8s} {'cache':6s} {'import s':>9s} " +
          " ".join(f"{'call ' + str(i + 1):>9s}" for i in range(args.calls)))
    for variant, passes, state, imp, times in rows:
        print(f"{variant:8s} {passes:8s} {state:6s} {imp:9.2f} " +
              " ".join(f"{t:9.3f}" for t in times))


if __name__ == "__main__":
    main()
