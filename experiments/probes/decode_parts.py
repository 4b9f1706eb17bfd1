"""(Probe, as it ran on the GPU host: python experiments/probes/decode_parts.py B L1,L2 S1,S2 [kernel,fused]
[OPTIONS;OPTIONS...] from the repository root; OPTIONS: decode's options as k=v,k=v, e.g.
"stages=4;block_n=128,warps=8", each set timed in turn, "-" for the defaults; contiguous=1 in a set: the
same keys in a contiguous (B, L, H_kv, d) cache, no block table.) Where a decoding step's time goes at small batch (issue 22): for each cache
length and num_splits, the step replayed alone from a CUDA graph (as experiments/decode.py's "CUDA graph"
row), the step's time inside a graph of 16 steps (4 input sets in turn), and the kernels' own durations
from torch.profiler (CUPTI) over eager calls; beside a copy of the same bytes, alone and 16 in a graph.
32 query heads on 8 K/V heads (DECODE_HEADS=H,H_KV to change), d=128, bf16, pages of 256 in a shuffled
block table.
(On exit the process may abort in a library's teardown after the profiler ran; the figures are printed
before.)"""
import os
import sys

sys.path.insert(0, os.getcwd())
import common  # noqa: E402

common.select_backend()
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import variants  # noqa: E402
from experiments.measure import timing  # noqa: E402

H, HKV = (int(x) for x in os.environ.get("DECODE_HEADS", "32,8").split(","))   # query, K/V heads
D, PS = 128, 256
NSETS, STEPS = 4, 16


def make(batch, length):
    kc = torch.randn(batch * length // PS, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * length // PS, device="cuda").to(torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    kcont = kc[table.long()].reshape(batch, length, HKV, D)
    vcont = vc[table.long()].reshape(batch, length, HKV, D)
    return q, kc, vc, table.contiguous(), lens, kcont, vcont


def graph_of(fn):
    return timing.capture_cuda_graph(fn)[0]


def kernel_us(fn, reps=5):
    """Median CUDA time of each kernel fn launches, over reps eager calls (each then synchronised)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = "combine" if "combine" in e.name else "split" if "build" in e.name \
                else e.name[:28]
            times.setdefault(name, []).append(e.device_time_total)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main():
    batch = int(sys.argv[1])
    lengths = [int(x) for x in sys.argv[2].split(",")]
    splits_list = [int(x) for x in sys.argv[3].split(",")]
    combines = sys.argv[4].split(",") if len(sys.argv) > 4 else ["kernel", "fused"]
    option_sets = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in o.split(",") if "=" in kv)
                   for o in (sys.argv[5].split(";") if len(sys.argv) > 5 else ["-"])]
    for length in lengths:
        sets = [make(batch, length) for _ in range(NSETS)]
        gb = 2 * batch * length * HKV * D * 2 / 1e9
        src = [torch.empty(int(gb * 1e9) // 2, dtype=torch.int16, device="cuda").fill_(1)
               for _ in range(NSETS)]
        dst = torch.empty_like(src[0])
        lone = timing.benchmark(lambda i: dst.copy_(src[i % NSETS])).median_ms
        g = graph_of(lambda: [dst.copy_(src[j % NSETS]) for j in range(STEPS)])
        many = timing.benchmark(lambda i: g.replay()).median_ms / STEPS
        print(f"B={batch} L={length} K/V {gb * 1e3:.1f} MB | copy of it: lone {lone * 1e3:.1f} us, "
              f"{STEPS} in a graph {many * 1e3:.1f} us a copy ({2 * gb / many:.2f} TB/s r+w)")
        for splits, combine, options in ((s, c, o) for s in splits_list for c in combines
                                         for o in option_sets):
            def step(s, c=combine, n=splits, o=options):
                o = dict(o)
                if o.pop("contiguous", 0):
                    return variants.decode(s[0], s[5], s[6], s[4], check=False, num_splits=n,
                                           combine=c, **o)
                return variants.decode(s[0], s[1], s[2], s[4], block_table=s[3], check=False,
                                       num_splits=n, combine=c, **o)
            graphs = [graph_of(lambda s=s: step(s)) for s in sets]
            lone = timing.benchmark(lambda i: graphs[i % NSETS].replay()).median_ms
            g = graph_of(lambda: [step(sets[j % NSETS]) for j in range(STEPS)])
            many = timing.benchmark(lambda i: g.replay()).median_ms / STEPS
            parts = "  ".join(f"{k} {v:.1f} us" for k, v in kernel_us(lambda: step(sets[0])).items())
            print(f"  splits={splits:3d} {combine:6s} {options or ''} lone replay {lone * 1e3:6.1f} us "
                  f"({gb / lone:5.2f} TB/s) | {STEPS} in a graph {many * 1e3:6.1f} us a step "
                  f"({gb / many:5.2f} TB/s) | eager kernels: {parts}", flush=True)
        sets = src = dst = g = graphs = None   # free the caches before the next length
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
