"""Host time per call, forward and backward, of the variants and of torch SDPA's flash backend, on
a problem too small for the GPU to matter (B=1, N=64, 128 heads of 64: one K/V step a block), and
the same calls replayed from a CUDA graph (what is left when the host path is gone).

    python experiments/host_overhead.py [variants, default fa2,fa3] [--rounds R]   (GPU host, torch)

Per call: `calls` (100) calls back to back, wall clock to a final synchronize, after 20 warm-up
calls. The lent hosts are VMs whose speed drifts within a run (the same call measured 77 and 119
us a minute apart), so every case is measured in R rounds (default 7), each round going once
through all the cases, SDPA's included: the table gives the median and the lowest of the R, and
"x sdpa" is the median over the rounds of the call's time over SDPA's same pass in the same round
(a drift then moves both): SDPA's flash backend chosen once for the run (not a context manager a
call, which made SDPA's calls ~20 us dearer before 2026-11-27), called on this layout (B, N, H, d)
transposed to its own and back; "x bhsd" against the bare call on (B, H, N, d) tensors; "x math"
against SDPA's math backend (aten's _scaled_dot_product_attention_math on (B, H, N, d): S and P
materialised by separate ops, the peer of `standard`).
"prepare" is the argument checks, output allocation and kernel views alone; "backward" is
variants.backward given O and LSE (torch: autograd.grad of O with dO, the forward's graph kept);
"autograd" is what a model pays: forward and backward through torch autograd
(`variants.attention`, a torch.autograd.Function; SDPA's own autograd node), autograd.grad of O
with dO from leaves q, k, v. From the third call of a geometry every variant replays the
recorded launches (common/host/replay.py; fa3 with its tensor maps made for each call's addresses);
FA_REPLAY=0 python experiments/host_overhead.py ... times the ordinary path.
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

    from experiments.measure.timing import capture_cuda_graph
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

    from experiments.measure import inputs
    return tuple(inputs.to_device(x, "torch") for x in
                 inputs.random_qkv(np.random.default_rng(0), 1, 64, 128, 64, "bfloat16")
                 + inputs.random_qkv(np.random.default_rng(1), 1, 64, 128, 64, "bfloat16")[:1])


def main(names=("fa2", "fa3"), rounds=7):
    import statistics

    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa_call

    import variants
    from common.hardware import target
    from common.host.problem import prepare

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
    # SDPA as a model calls it: the backend chosen once (main enters sdpa_kernel around the whole
    # measurement, not a call: its context manager alone costs a call ~20 us), on flash_attn's
    # (B, N, H, d) layout, transposed to SDPA's and back as a model holding that layout does
    # ("sdpa_flash"); "sdpa_bhsd" is the bare call on (B, H, N, d) tensors, SDPA's own layout.
    def sdpa(q, k, v):
        return sdpa_call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    cases["sdpa_flash", "forward"] = lambda: sdpa(q, k, v)
    cases["sdpa_bhsd", "forward"] = lambda: sdpa_call(q_t, k_t, v_t)
    # SDPA's math backend, the peer of `standard` (S and P materialised by separate ATen ops), as
    # the op it dispatches to (a per-call sdpa_kernel context would add ~20 us)
    math_op = torch.ops.aten._scaled_dot_product_attention_math
    cases["sdpa_math", "forward"] = lambda: math_op(q_t, k_t, v_t)[0]
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
    print(f"{'what':12s} {'pass':9s} {'median':>8s} {'lowest':>8s} {'graph':>8s} {'x sdpa':>7s} "
          f"{'x bhsd':>7s} {'x math':>7s}")
    for (name, pass_), times in sorted(eager.items(), key=lambda c: c[0][0].startswith("sdpa")):
        ratios = []
        for peer_name in ("sdpa_flash", "sdpa_bhsd", "sdpa_math"):
            peer = eager.get((peer_name, pass_))
            ratios.append(statistics.median(t / p for t, p in zip(times, peer))
                          if peer and name != "prepare" else float("nan"))
        print(f"{name:12s} {pass_:9s} {statistics.median(times):8.1f} {min(times):8.1f} "
              f"{graph[name, pass_]:8.1f} {ratios[0]:7.2f} {ratios[1]:7.2f} {ratios[2]:7.2f}",
              flush=True)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="?", default="fa2,fa3")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        main(tuple(args.variants.split(",")), args.rounds)
