"""Context parallelism on GPUs (variants/context_parallel.py): checked, timed, and drawn.

    torchrun --standalone --nproc_per_node=2 experiments/context_parallel.py check
    torchrun --standalone --nproc_per_node=W experiments/context_parallel.py bench \
        [--seqlens 8192,16384,32768,65536] [--heads 16] [--head-dim 128] [--variant fa2] \
        [--masks causal-zigzag,causal-contiguous,full] [--csv cp.csv]
    python experiments/context_parallel.py plot cp.csv [--out cp.png]

`check [--variants fa2,fa3]`: every rank builds the same full problem (bf16, GQA 8 query heads over
2 K/V heads), runs the ring on its part with NCCL and each variant (fa3: forward only), and
compares its part of O, L and of dQ, dK, dV with a float64 answer (torch on the GPU) under the
single-kernel tolerances of experiments/measure/checks.py; the one-GPU variant's errors are printed beside
them. It ends with "all match" when every rank passed.

`bench`: for each total sequence length N (each GPU holds N / W), with B = 1 and H x d = 2048 as
the FA2 paper's shapes, the time of the ring's forward and forward + backward (CUDA events, the
slowest rank's median), split into what it is made of:
  compute_ms   the same ring loop with the transfers left out (each rank reuses its own K/V:
               the blocks, kernels and merges are the same shapes);
  comm_ms      the transfers alone (W - 1 exchanges of K and V, no kernels);
  exposed_ms   per step, the time the stream waited for the next K/V after the step's kernels
               (`Timeline`: received - computed), summed over the steps: the transfer not hidden;
  serial_ms    the ring with overlap=False (each transfer waited for before the step's kernel);
and the peak memory one GPU allocated for a forward + backward (torch.cuda.max_memory_allocated,
inputs included). Run it with W = 1 (a ring of one: the variant alone) and W = 2 into one CSV
(`--csv` appends) and `plot` draws time and memory per GPU against N.
"""
import argparse
import csv
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from experiments import append_row  # noqa: E402

FIELDS = ["gpu", "world", "seqlen", "mask", "variant", "batch", "heads", "head_dim", "pass",
          "ms", "compute_ms", "comm_ms", "exposed_ms", "serial_ms", "tflops_per_gpu",
          "peak_gb", "kv_mb_per_step"]


def pin_local_gpu():
    """One GPU a process, before torch or Numba touch CUDA: torchrun's LOCAL_RANK-th visible GPU
    becomes this process's device 0 (Numba launches on device 0's context)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in listed.split(",") if g] if listed else None
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[local] if gpus else str(local)


def setup():
    pin_local_gpu()
    import torch
    import torch.distributed as dist
    if "RANK" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    return torch, dist


def mask_settings(mask):
    """'full' | 'causal-zigzag' | 'causal-contiguous' -> (causal, layout)."""
    if mask == "full":
        return False, "contiguous"
    causal, _, layout = mask.partition("-")
    if causal != "causal" or layout not in ("zigzag", "contiguous"):
        raise ValueError(f"mask must be full, causal-zigzag or causal-contiguous, got {mask!r}")
    return True, layout


def float64_attention(torch, q, k, v, do, causal, scale):
    """O, L and (dQ, dK, dV) in float64 on the GPU (GQA: K/V heads repeated, gradients summed)."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(group, dim=2) for x in (k64, v64))
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kk) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vv)
    grads = torch.autograd.grad(o, (q64, k64, v64), do.double())
    return o.detach(), lse.detach(), grads


def check(args):
    torch, dist = setup()
    import variants
    import variants.context_parallel as cp
    from experiments.measure import checks
    rank, world = dist.get_rank(), dist.get_world_size()
    all_ok = True
    for variant in args.variants.split(","):
        has_backward = hasattr(variants.get(variant), "backward")
        for mask in ("causal-zigzag", "causal-contiguous", "full"):
            for head_dim in (64, 128):
                ok = check_case(torch, cp, variants, checks, rank, world, variant, mask, head_dim,
                                has_backward)
                all_ok &= ok
    flag = torch.tensor([int(all_ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("all match" if flag.item() else "MISMATCH on some rank")
    dist.destroy_process_group()
    return 0 if flag.item() else 1


def check_case(torch, cp, variants, checks, rank, world, variant, mask, head_dim, has_backward):
    """One (variant, mask, head_dim): this rank's part of the ring's O, L (and dQ, dK, dV when the
    variant has a backward) against float64, the one-GPU variant's errors printed beside them."""
    causal, layout = mask_settings(mask)
    n = 1024 * world
    g = torch.Generator(device="cuda").manual_seed(head_dim + len(mask))
    make = lambda h: torch.randn(2, n, h, head_dim, device="cuda", generator=g,  # noqa: E731
                                 dtype=torch.bfloat16)
    q, k, v, do = make(8), make(2), make(2), make(8)
    scale = 1 / math.sqrt(head_dim)
    o64, lse64, grads64 = float64_attention(torch, q, k, v, do, causal, scale)
    part = lambda x, dim=1: cp.shard(x, rank, world, layout, dim).contiguous()  # noqa: E731
    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    local_forward = cp.kernels(variant, scale)[0]
    o, lse = cp.ring_forward(ql.detach(), kl.detach(), vl.detach(), cp.TorchRing(), local_forward,
                             causal=causal, layout=layout)
    o1, _ = variants.forward(q, k, v, variant=variant, causal=causal)
    grads = grads1 = None
    if has_backward:      # through the autograd Function, as a model calls it
        o_fn = cp.attention(ql, kl, vl, variant=variant, causal=causal, layout=layout)
        assert torch.equal(o_fn, o), "the autograd Function's O differs from ring_forward's"
        grads = torch.autograd.grad(o_fn, (ql, kl, vl), part(do))
        q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
        grads1 = torch.autograd.grad(variants.attention(q1, k1, v1, variant=variant,
                                                        causal=causal), (q1, k1, v1), do)
        grads1 = [part(x) for x in grads1]
    grads64 = [part(x) for x in grads64] if has_backward else None
    ring = _errors(torch, checks, o, part(o64), grads, grads64, lse, part(lse64, 2))
    one = _errors(torch, checks, part(o1), part(o64), grads1, grads64)
    text = lambda e: " ".join(f"{k} {e[k]:.2e}" for k in ("o", "lse", "dq", "dk", "dv")  # noqa: E731
                              if k in e)
    print(f"rank {rank}/{world} {variant} {mask:18s} d={head_dim:3d}  ring: {text(ring)} "
          f"{'ok' if ring['ok'] else 'FAIL'}   one GPU: {text(one)}", flush=True)
    return ring["ok"]


def _errors(torch, checks, o, o_ref, grads, grads_ref, lse=None, lse_ref=None):
    """Relative L2 errors of O (and of L, the gradients, when given) against float64, and whether
    they pass experiments/measure/checks.py's bounds."""
    import numpy as np
    host = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    no_lse = np.zeros(1)
    got = checks.compare(host(o), no_lse if lse is None else host(lse), host(o_ref),
                         no_lse if lse_ref is None else host(lse_ref), "bfloat16")
    out = {"o": got["rel_err"], "ok": got["ok"]}
    if lse is not None:
        out["lse"] = got["lse_err"]
    if grads is not None:
        gr = checks.compare_gradients([host(x) for x in grads], [host(x) for x in grads_ref],
                                      "bfloat16")
        out.update(dq=gr["dq"], dk=gr["dk"], dv=gr["dv"], ok=out["ok"] and gr["ok"])
    return out


class _NoTransfer:
    """A ring that moves nothing: each rank keeps its own K/V (the compute-only baseline)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def exchange(self, tensors):
        import variants.context_parallel as cp
        return cp.Done(tensors)


def median_ms(torch, dist, fn, iters):
    """The slowest rank's median time of fn() over `iters` runs (after one warm-up), CUDA events."""
    fn()
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    mid = torch.tensor([times[len(times) // 2]], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(mid, op=dist.ReduceOp.MAX)
    return mid.item()


def bench(args):
    torch, dist = setup()
    import variants.context_parallel as cp
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    gpu = torch.cuda.get_device_name(0)
    rows = []
    for seqlen in [int(s) for s in args.seqlens.split(",")]:
        for mask in args.masks.split(","):
            causal, layout = mask_settings(mask)
            if world == 1 and layout == "contiguous" and causal:
                continue                       # a ring of one has no layout
            n = seqlen // world
            make = lambda: torch.randn(args.batch, n, args.heads, args.head_dim,  # noqa: E731
                                       device="cuda", dtype=torch.bfloat16)
            q, k, v, do = make(), make(), make(), make()
            ring = cp.TorchRing()
            kernels = cp.kernels(args.variant, 1 / math.sqrt(args.head_dim))
            quiet = _NoTransfer(ring.rank, ring.world)
            settings = dict(causal=causal, layout=layout)

            def forward(r=ring, overlap=True, timeline=None):
                return cp.ring_forward(q, k, v, r, kernels[0], overlap=overlap, timeline=timeline,
                                       **settings)

            o, lse = forward()

            def backward(r=ring, overlap=True):
                return cp.ring_backward(do, q, k, v, o, lse, r, kernels[1], overlap=overlap,
                                        **settings)

            dk32, dv32 = (torch.zeros(k.shape, device="cuda") for _ in range(2))

            def transfers(with_backward):
                """The transfers of a forward (W - 1 exchanges of K, V) or of a forward and
                backward (as many again, and W of the float32 dK, dV), nothing else."""
                steps = [(k, v)] * (world - 1)
                if with_backward:
                    steps += [(k, v)] * (world - 1) + [(dk32, dv32)] * world
                for tensors in steps:
                    ring.exchange(tensors).wait()

            flops = 4 * args.batch * args.heads * seqlen * seqlen * args.head_dim \
                / (2 if causal else 1) / world
            kv_mb = 2 * k.numel() * k.element_size() / 1e6
            passes = {"fwd": (forward, 1.0)}
            if args.variant != "fa3":           # fa3 is forward only
                passes["fwd_bwd"] = (lambda **kw: (forward(**kw), backward(**kw)), 3.5)
            for name, (fn, flop_factor) in passes.items():
                ms = median_ms(torch, dist, fn, args.iters)
                compute = median_ms(torch, dist, lambda: fn(r=quiet), args.iters)
                serial = median_ms(torch, dist, lambda: fn(overlap=False), args.iters)
                comm = median_ms(torch, dist, lambda: transfers(name == "fwd_bwd"),
                                 args.iters) if world > 1 else 0.0
                exposed = _exposed(torch, dist, forward) if name == "fwd" else float("nan")
                torch.cuda.reset_peak_memory_stats()
                if name == "fwd_bwd":
                    fn()
                    torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 1e9
                rows.append(dict(gpu=gpu, world=world, seqlen=seqlen, mask=mask,
                                 variant=args.variant, batch=args.batch, heads=args.heads,
                                 head_dim=args.head_dim, **{"pass": name}, ms=round(ms, 3),
                                 compute_ms=round(compute, 3), comm_ms=round(comm, 3),
                                 exposed_ms=round(exposed, 3), serial_ms=round(serial, 3),
                                 tflops_per_gpu=round(flop_factor * flops / ms / 1e9, 1),
                                 peak_gb=round(peak, 3) if name == "fwd_bwd" else "",
                                 kv_mb_per_step=round(kv_mb, 1)))
                if rank == 0:
                    print(_row_text(rows[-1]), flush=True)
                    if args.csv:                 # row by row: a run cut short keeps its rows
                        append_row(args.csv, rows[-1], FIELDS)
            q = k = v = do = o = lse = dk32 = dv32 = None   # freed before the next length
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _exposed(torch, dist, forward):
    """The forward's exposed transfer time: per step, the stream's wait for the next K/V after
    the step's kernels were queued (received - computed), summed; the slowest rank's."""
    import variants.context_parallel as cp
    timeline = cp.Timeline()
    if dist.is_initialized():
        dist.barrier()
    forward(timeline=timeline)
    torch.cuda.synchronize()
    exposed = sum(s.get("received", s["computed"]) - s["computed"] for s in timeline.steps())
    t = torch.tensor([exposed], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _row_text(r):
    return (f"W={r['world']} N={r['seqlen']:6d} {r['mask']:18s} {r['pass']:7s} "
            f"{r['ms']:9.2f} ms  compute {r['compute_ms']:9.2f}  comm {r['comm_ms']:7.2f}  "
            f"exposed {r['exposed_ms']:6.2f}  serial {r['serial_ms']:9.2f}  "
            f"{r['tflops_per_gpu']:6.1f} TFLOP/s/GPU  peak {r['peak_gb'] or '-'} GB")


def plot(args):
    """Per GPU, against the total sequence length: forward + backward time (solid: the ring;
    dotted: its compute alone; dashed: its transfers alone) and peak memory, one colour per W."""
    from experiments.plot import _pyplot, _save
    with open(args.csv) as f:
        rows = [r for r in csv.DictReader(f) if not r["gpu"].startswith("#")]
    plt = _pyplot()
    masks = sorted({r["mask"] for r in rows})
    fig, axes = plt.subplots(2, len(masks), figsize=(4.2 * len(masks), 7), squeeze=False)
    colours = {1: "tab:gray", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}
    for col, mask in enumerate(masks):
        # a ring of one has no layout: its causal rows (under causal-zigzag) serve both panels
        sel = [r for r in rows if r["pass"] == "fwd_bwd" and (
            r["mask"] == mask or (int(r["world"]) == 1 and mask.startswith("causal")
                                  and r["mask"].startswith("causal")))]
        for world in sorted({int(r["world"]) for r in sel}):
            pts = sorted((int(r["seqlen"]), r) for r in sel if int(r["world"]) == world)
            xs = [p[0] for p in pts]
            c = colours.get(world, None)
            axes[0][col].plot(xs, [float(p[1]["ms"]) for p in pts], "o-", color=c,
                              label=f"{world} GPU{'s' if world > 1 else ''}")
            if world > 1:
                axes[0][col].plot(xs, [float(p[1]["compute_ms"]) for p in pts], ":", color=c,
                                  label=f"{world} GPUs, compute only")
                axes[0][col].plot(xs, [float(p[1]["comm_ms"]) for p in pts], "--", color=c,
                                  label=f"{world} GPUs, transfers only")
            axes[1][col].plot(xs, [float(p[1]["peak_gb"]) for p in pts], "o-", color=c,
                              label=f"{world} GPU{'s' if world > 1 else ''}")
        for row, label in ((0, "forward + backward, ms"), (1, "peak memory per GPU, GB")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("total sequence length")
            ax.set_ylabel(label)
            ax.set_title(mask, fontsize=9)
            ax.legend(fontsize=7)
    out = args.out or os.path.splitext(args.csv)[0] + ".png"
    _save(plt, fig, rows, "context parallelism (ring attention), per GPU", out)
    print(out)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--variants", default="fa2", help="comma-separated; fa3 is checked forward only")
    b = sub.add_parser("bench")
    b.add_argument("--seqlens", default="8192,16384,32768,65536")
    b.add_argument("--masks", default="causal-zigzag,causal-contiguous,full")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--head-dim", type=int, default=128)
    b.add_argument("--variant", default="fa2")
    b.add_argument("--iters", type=int, default=5)
    b.add_argument("--csv", default="")
    p = sub.add_parser("plot")
    p.add_argument("csv")
    p.add_argument("--out", default="")
    args = ap.parse_args(argv)
    return {"check": check, "bench": bench, "plot": plot}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
