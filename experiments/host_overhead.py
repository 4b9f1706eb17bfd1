"""Host time per call, forward and backward, of the variants and of torch SDPA's flash backend, on
a problem too small for the GPU to matter (B=1, N=64, 128 heads of 64: one K/V step a block), and
the same calls replayed from a CUDA graph (what is left when the host path is gone).

    python experiments/host_overhead.py [variants, default fa2,fa3] [--rounds R]   (GPU host, torch)

Per call: `calls` (100) calls back to back, wall clock to a final synchronize, after 20 warm-up
calls. The lent hosts are VMs whose speed drifts within a run (the same call measured 77 and 119
us a minute apart), so every case is measured in R rounds (default 7), each round going once
through all the cases, SDPA's included: the table gives the median and the lowest of the R, and
"x sdpa" is the median over the rounds of the call's time over SDPA's same pass in the same round
(a drift then moves both). "prepare" is the argument checks, output allocation and kernel views
alone; "backward" is variants.backward given O and LSE (torch: autograd.grad of O with dO, the
forward's graph kept); "autograd" is what a model pays: forward and backward through torch
autograd (`variants.attention`, a torch.autograd.Function; SDPA's own autograd node),
autograd.grad of O with dO from leaves q, k, v.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.select_backend()


def per_call_us(fn, calls=100):
    import torch
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def graph_replay_us(fn, calls=300):
    """Per-call time of fn captured once in a CUDA graph and replayed `calls` times (NaN if the
    capture fails: torch 2.11 cannot capture autograd.grad through SDPA's flash backward)."""
    import torch

    from common.timing import capture_cuda_graph
    try:
        graph, _ = capture_cuda_graph(fn, warmup=3)
    except (RuntimeError, torch.AcceleratorError) as e:
        print(f"# graph capture failed: {str(e).splitlines()[0]}")
        torch.cuda.synchronize()
        return float("nan")
    return per_call_us(graph.replay, calls)


def small_problem():
    """q, k, v, dO: torch bf16, B=1, N=64, 128 heads of 64 (the GPU's time is a few µs)."""
    import numpy as np

    from common import inputs
    return tuple(inputs.to_device(x, "torch") for x in
                 inputs.random_qkv(np.random.default_rng(0), 1, 64, 128, 64, "bfloat16")
                 + inputs.random_qkv(np.random.default_rng(1), 1, 64, 128, 64, "bfloat16")[:1])


def main(names=("fa2", "fa3"), rounds=7):
    import statistics

    import torch

    import variants
    from common import target
    from common.problem import prepare
    from experiments import peers

    q, k, v, do = small_problem()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    cases = {}     # (name, pass) -> fn
    for name in names:
        module = variants.get(name)
        o, lse = module.forward(q, k, v)
        cases[name, "forward"] = lambda m=module: m.forward(q, k, v)
        cases[name, "backward"] = lambda m=module, o=o, lse=lse: m.backward(do, q, k, v, o, lse)
        cases[name, "autograd"] = lambda n=name: torch.autograd.grad(
            variants.attention(*leaves, variant=n), leaves, do)
    cases["prepare", "forward"] = lambda: prepare(
        q, q, q, causal=False, softmax_scale=None, out=None, head_dims=(64, 128), variant="fa2")
    sdpa = peers.forward_fn("sdpa_flash", False, None, False)

    def sdpa_forward():
        with torch.no_grad():
            return sdpa(q, k, v)

    cases["sdpa_flash", "forward"] = sdpa_forward
    cases["sdpa_flash", "autograd"] = lambda: torch.autograd.grad(sdpa(*leaves), leaves, do)
    # Replayed from CUDA graphs first: a capture fails once the leaves' gradient nodes are held
    # by a graph made outside it (SDPA's backward case below keeps its forward's graph).
    graph = {case: float("nan") if case == ("prepare", "forward") else graph_replay_us(fn)
             for case, fn in cases.items()}
    o_t = sdpa(*leaves)
    cases["sdpa_flash", "backward"] = lambda: torch.autograd.grad(o_t, leaves, do,
                                                                  retain_graph=True)
    graph["sdpa_flash", "backward"] = float("nan")

    eager = {case: [] for case in cases}
    for _ in range(rounds):     # interleaved: each round measures every case once
        for case, fn in cases.items():
            eager[case].append(per_call_us(fn))

    print(f"# {target.describe()}, torch {torch.__version__}; microseconds a call, {rounds} rounds "
          "of 100 calls")
    print(f"{'what':12s} {'pass':9s} {'median':>8s} {'lowest':>8s} {'graph':>8s} {'x sdpa':>7s}")
    for (name, pass_), times in sorted(eager.items(), key=lambda c: c[0][0] == "sdpa_flash"):
        peer = eager.get(("sdpa_flash", pass_))
        ratio = statistics.median(t / p for t, p in zip(times, peer)) \
            if peer and name != "prepare" else float("nan")
        print(f"{name:12s} {pass_:9s} {statistics.median(times):8.1f} {min(times):8.1f} "
              f"{graph[name, pass_]:8.1f} {ratio:7.2f}", flush=True)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="?", default="fa2,fa3")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    main(tuple(args.variants.split(",")), args.rounds)
