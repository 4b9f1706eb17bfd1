"""Host time per call, forward and backward, of the variants and of torch SDPA's flash backend, on
a problem too small for the GPU to matter (B=1, N=64, 128 heads of 64: one K/V step a block), and
the same calls replayed from a CUDA graph (what is left when the host path is gone).

    python experiments/host_overhead.py [variants, default fa2,fa3]     (GPU host, torch installed)

Per call: 300 calls back to back, wall clock to a final synchronize, after 20 warm-up calls.
"prepare" is the argument checks, output allocation and kernel views alone; "backward" is
variants.backward given O and LSE (torch: autograd.grad of O with dO, the forward's graph kept);
"autograd" is what a model pays: forward and backward through torch autograd
(`variants.attention`, a torch.autograd.Function; SDPA's own autograd node), autograd.grad of O
with dO from leaves q, k, v.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.select_backend()


def per_call_us(fn, calls=300):
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


def main(names=("fa2", "fa3")):
    import torch

    import variants
    from common import target
    from common.problem import prepare
    from experiments import peers

    q, k, v, do = small_problem()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    print(f"# {target.describe()}, torch {torch.__version__}; microseconds a call")
    print(f"{'what':12s} {'pass':9s} {'eager':>8s} {'graph':>8s}")

    def report(name, pass_, eager, graph=float("nan")):   # printed as measured
        print(f"{name:12s} {pass_:9s} {eager:8.1f} {graph:8.1f}", flush=True)

    for name in names:
        module = variants.get(name)
        o, lse = module.forward(q, k, v)
        fwd = lambda m=module: m.forward(q, k, v)                                 # noqa: E731
        bwd = lambda m=module: m.backward(do, q, k, v, o, lse)                    # noqa: E731
        both = lambda n=name: torch.autograd.grad(                                # noqa: E731
            variants.attention(*leaves, variant=n), leaves, do)
        report(name, "forward", per_call_us(fwd), graph_replay_us(fwd))
        report(name, "backward", per_call_us(bwd), graph_replay_us(bwd))
        report(name, "autograd", per_call_us(both), graph_replay_us(both))
    report("prepare", "forward", per_call_us(
        lambda: prepare(q, q, q, causal=False, softmax_scale=None, out=None, head_dims=(64, 128),
                        variant="fa2")))
    sdpa = peers.forward_fn("sdpa_flash", False, None, False)
    with torch.no_grad():
        report("sdpa_flash", "forward", per_call_us(lambda: sdpa(q, k, v)),
               graph_replay_us(lambda: sdpa(q, k, v)))
    o_t = sdpa(*leaves)
    report("sdpa_flash", "backward", per_call_us(
        lambda: torch.autograd.grad(o_t, leaves, do, retain_graph=True)))
    both = lambda: torch.autograd.grad(sdpa(*leaves), leaves, do)                 # noqa: E731
    report("sdpa_flash", "autograd", per_call_us(both), graph_replay_us(both))


if __name__ == "__main__":
    main(tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else ("fa2", "fa3"))
