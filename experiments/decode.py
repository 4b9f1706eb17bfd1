"""Decoding against a KV cache at the memory-bandwidth limit (issue: Flash-Decoding), one GPU, one run.

    python experiments/decode.py [--batches 1,4,8] [--lengths 16384,65536,131072] [--heads 32]
                                 [--heads-kv 8] [--head-dim 128] [--page-size 256] [--csv PATH]
                                 [--only-decode] [--combine kernel,fused] [--pdl 0,1]
                                 [--merge-warps block,combine]

One new token a sequence (q: (B, 1, H, d), bf16) against caches of L tokens a sequence, paged
(pages of --page-size tokens, a shuffled block table). Each row is checked against float64 on one
sequence, then timed (CUDA events, median; two input sets when the caches fit in L2 twice):
- decode: variants.decode, split-KV with the heuristic's num_splits (the column says how many),
  the splits merged by the combine kernel (combine="kernel");
- decode, CUDA graph: the same call captured once in a CUDA graph and replayed (torch on a GPU):
  the kernels without the host's time a call, what a serving loop that replays its decoding step
  pays (check=False and a fixed num_splits read nothing back, so the step captures);
- decode, 16 in a graph: 16 steps (the input sets in turn) captured in one CUDA graph, its replay's
  time / 16: a step as a model's captured decoding step runs it, one layer's attention after
  another's, without the lone replay's fixed cost of starting a graph (~3 us on an H100);
- decode, PDL (and its graphs; --pdl 0,1): the combine kernel launched as a programmatic dependent
  of the split kernel (pdl=True, as FA3 launches its combine kernel), not as an ordinary kernel;
- decode, warp parts (and its graphs; --merge-warps block,combine): combine="kernel" with
  merge_warps="combine", each warp of a split block storing its own part for the combine kernel
  to merge, where the default ("block") has the block merge its warps and store one part;
- decode, fused (and its CUDA graph): the same with combine="fused", the splits merged by the
  split kernel's last block of each sequence and K/V head (one launch, not two); timed beside the
  rows above in the same run (--combine picks either or both; no fused rows where num_splits = 1,
  which has nothing to merge);
- no split: the same kernel with split_kv=False (one thread block a sequence and K/V head);
- contiguous: decode on a (B, L, H_kv, d) cache, no block table;
- fa2: variants.forward with seqlen_q = 1 (FA2's grid: one query block a sequence and head);
- sdpa_flash, sdpa_cudnn: torch SDPA on the contiguous cache (enable_gqa), when they take it; and
  each replayed from a CUDA graph, alone and 16 in a graph, as decode's graph rows.
GB/s = bytes of K and V read / time; the bar is >= 70% (goal 85%) of the copy bandwidth measured
in the same run (a device-to-device copy of 2 GiB: bytes read + written / time).
"""
import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GRAPH_STEPS = 16   # decoding steps captured in one graph for the "in a graph" rows


def copy_bandwidth(torch):
    """GB/s of a device-to-device copy of 2 GiB (read + write), median of CUDA-event timings."""
    from experiments.measure import timing
    x = torch.empty(2 ** 30, dtype=torch.int16, device="cuda").fill_(1)
    y = torch.empty_like(x)
    ms = timing.benchmark(lambda i: y.copy_(x), warmup=3, min_reps=10, max_reps=50).median_ms
    return 2 * x.numel() * x.element_size() / ms / 1e6


def measure_size(batch, length, *, heads=32, heads_kv=8, head_dim=128, page_size=256,
                 extra_splits=(), peers_on=True, copy_gbs=float("nan"), rng=None, others=True,
                 combines=("kernel", "fused"), pdls=(False,), merges=("block",)):
    """The rows of one (batch, cache length): each kernel checked on one sequence against float64
    (decode's, with each combine), then timed. Returns dicts with kernel, ms, gbs, of_copy, vs_fa2,
    splits, host_us. others=False: decode and its CUDA-graph replay only (no split, contiguous,
    fa2, peers). combines: the ways of merging the splits timed (decoding.COMBINES); merges: the
    merge_warps values timed with combine="kernel" (decoding.MERGES)."""
    import numpy as np
    from numba import cuda

    import variants
    from common.hardware import target
    from experiments.measure import checks, inputs, reference, timing
    from variants import decoding

    library = inputs.default_library()
    torch = None
    if library == "torch":
        import torch
    h, h_kv, d, ps = heads, heads_kv, head_dim, page_size
    dtype = "bfloat16"
    rng = np.random.default_rng(0) if rng is None else rng
    out = []
    bench = dict(warmup=3, min_reps=10, max_reps=200, target_ms=200)
    kv_bytes = 2 * batch * length * h_kv * d * 2
    n_sets = 2 if 2 * kv_bytes < 200e6 else 1
    pages_per_seq = length // ps
    sets = []
    for _ in range(n_sets):
        # caches made on the device (host copies of 8 GiB are slow): random bits of bf16
        # values in [-2, 2), the same memory seen paged and contiguous
        if torch is not None:
            kc = torch.randn(batch * pages_per_seq, ps, h_kv, d, device="cuda",
                             dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
            perm = torch.randperm(batch * pages_per_seq, device="cuda").to(torch.int32)
            table = perm.reshape(batch, pages_per_seq).contiguous()
            lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            # the contiguous cache: each sequence's pages gathered in order
            kcont = kc[table.long()].reshape(batch, length, h_kv, d)
            vcont = vc[table.long()].reshape(batch, length, h_kv, d)
        else:
            hq, hk, hv = inputs.random_qkv(rng, batch, 1, h, d, dtype, seqlen_k=length,
                                           heads_kv=h_kv)
            perm = rng.permutation(batch * pages_per_seq).astype(np.int32)
            table_h = perm.reshape(batch, pages_per_seq)
            kc_h = np.empty((batch * pages_per_seq, ps, h_kv, d), hk.dtype)
            vc_h = np.empty_like(kc_h)
            for b in range(batch):
                for j in range(pages_per_seq):
                    kc_h[table_h[b, j]] = hk[b, j * ps:(j + 1) * ps]
                    vc_h[table_h[b, j]] = hv[b, j * ps:(j + 1) * ps]
            q, kc, vc, table, kcont, vcont = (inputs.to_device(x, library) for x in
                                              (hq, kc_h, vc_h, table_h, hk, hv))
            lens = inputs.to_device(np.full(batch, length, np.int32), library)
        sets.append((q, kc, vc, table, lens, kcont, vcont))

    splits = decoding.num_splits_heuristic(batch, h_kv, length,
                                           target.multiprocessor_count(),
                                           decoding.Config.block_n)
    unknown = set(combines) - set(decoding.COMBINES)
    if unknown:
        raise ValueError(f"combines: {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(decoding.COMBINES)}")
    if splits == 1:   # nothing to merge: one kernel whichever way
        combines = [c for c in combines if c == "kernel"] or ["kernel"]
    # check one sequence of set 0 against float64, with each combine
    q, kc, vc, table, lens, kcont, vcont = sets[0]
    b = batch - 1
    ref = reference.attention(inputs.to_host(q[b:b + 1]), inputs.to_host(kcont[b:b + 1]),
                              inputs.to_host(vcont[b:b + 1]))
    # the ways of merging timed: (combine, pdl, merge_warps); PDL (a programmatic dependent
    # launch of the combine kernel) and merge_warps only mean something for combine="kernel"
    unknown = set(merges) - set(decoding.MERGES)
    if unknown:
        raise ValueError(f"merges: {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(decoding.MERGES)}")
    kernel_ways = splits > 1
    ways = list(dict.fromkeys(   # pdl None: decode's own default (decoding.pdl_by_default)
        (c, p if p is None else bool(p), m) for c in combines
        for m in ((merges or ["block"]) if c == "kernel" and kernel_ways else ["block"])
        for p in ((pdls or [False]) if c == "kernel" and kernel_ways else [False])))

    def tag(way):
        combine, pdl, merge = way
        return ("" if combine == "kernel" else f", {combine}") + \
            (", warp parts" if combine == "kernel" and merge == "combine" else "") + \
            (", PDL" if pdl or (pdl is None and combine == "kernel" and kernel_ways
                                and decoding.pdl_by_default()) else "")

    def options(way):
        return dict(combine=way[0], pdl=way[1], merge_warps=way[2])

    verdict = {}
    for way in ways:
        o, lse = variants.decode(q, kc, vc, lens, block_table=table, **options(way))
        got = checks.compare(inputs.to_host(o)[b:b + 1], inputs.to_host(lse)[b:b + 1], *ref,
                             dtype)
        verdict[way] = "ok" if got["ok"] else "FAIL"
    ok = "ok" if all(v == "ok" for v in verdict.values()) else "FAIL"

    def timed(fn):
        return timing.benchmark(lambda i: fn(*sets[i % n_sets]), **bench).median_ms

    def step(q, kc, vc, t, n, *_, way=("kernel", False, "block")):
        return variants.decode(q, kc, vc, n, block_table=t, check=False, num_splits=splits,
                               **options(way))

    rows, row_check = {}, {}
    for way in ways:   # "decode (splits=S)" / "decode, fused (splits=S)", then graphs
        name = f"decode{tag(way)} (splits={splits})"
        rows[name] = timed(lambda *s, w=way: step(*s, way=w))
        row_check[name] = verdict[way]

    def replayed(fn):   # fn(*set) captured once per input set, the graphs replayed in turn
        graphs = [timing.capture_cuda_graph(lambda s=s: fn(*s))[0] for s in sets]
        return timing.benchmark(lambda i: graphs[i % n_sets].replay(), **bench).median_ms

    def in_one_graph(fn):   # GRAPH_STEPS calls (the input sets in turn) in one graph, per call
        graph = timing.capture_cuda_graph(
            lambda: [fn(*sets[j % n_sets]) for j in range(GRAPH_STEPS)])[0]
        return timing.benchmark(lambda i: graph.replay(), **bench).median_ms / GRAPH_STEPS

    graphs_on = torch is not None and not target.SIMULATOR
    for way in ways if graphs_on else ():
        def fn(*s, way=way):
            return step(*s, way=way)
        rows[f"decode{tag(way)}, CUDA graph"] = replayed(fn)
        row_check[f"decode{tag(way)}, CUDA graph"] = verdict[way]
        name = f"decode{tag(way)}, {GRAPH_STEPS} in a graph"
        rows[name] = in_one_graph(fn)
        row_check[name] = verdict[way]
    if others:
        rows["decode, no split"] = timed(lambda q, kc, vc, t, n, *_:
                                         variants.decode(q, kc, vc, n, block_table=t,
                                                         check=False, split_kv=False))
        rows["decode, contiguous"] = timed(lambda q, kc, vc, t, n, kk, vv:
                                           variants.decode(q, kk, vv, n, check=False,
                                                           num_splits=splits))
    for s in (int(x) for x in extra_splits if x):
        rows[f"decode (splits={s})"] = timed(
            lambda q, kc, vc, t, n, *_, s=s: variants.decode(q, kc, vc, n, block_table=t,
                                                             check=False, num_splits=s))
    # the host's time a call (launches queue ahead: 50 calls enqueued, then one wait)
    calls = 1 if target.SIMULATOR else 50
    start = time.perf_counter()
    for _ in range(calls):
        step(*sets[0], way=ways[0])
    host_us = (time.perf_counter() - start) / calls * 1e6
    host_row = f"decode{tag(ways[0])} (splits={splits})"   # the call the host time is of
    cuda.synchronize()
    if others:
        rows["fa2"] = timed(lambda q, kc, vc, t, n, kk, vv: variants.forward(q, kk, vv))
    if others and peers_on and torch is not None:
        from experiments import peers
        for name in ("sdpa_flash", "sdpa_cudnn"):
            fn = peers.forward_fn(name, False, None, h != h_kv)
            def peer(q, kc, vc, t, n, kk, vv, fn=fn):
                return fn(q, kk, vv)
            try:
                rows[name] = timed(peer)
            except RuntimeError as exc:   # a backend that does not take this shape
                print(f"  {name}: {str(exc).splitlines()[0][:100]}", flush=True)
                rows[name] = float("nan")
                continue
            if graphs_on:   # the peer's kernels on the decode rows' footing, without its host time
                rows[f"{name}, CUDA graph"] = replayed(peer)
                rows[f"{name}, {GRAPH_STEPS} in a graph"] = in_one_graph(peer)
    base = rows.get("fa2", float("nan"))
    print(f"B={batch:<2} L={length:<7} host: {host_us:.0f} us a decode call", flush=True)
    for name, ms in rows.items():
        gbs = kv_bytes / ms / 1e6
        out.append(dict(kernel=name, batch=batch, seqlen_k=length, heads=h, heads_kv=h_kv,
                        head_dim=d, page_size=ps, ms=round(ms, 4), gbs=round(gbs, 1),
                        of_copy=round(gbs / copy_gbs, 3), vs_fa2=round(base / ms, 2),
                        host_us=round(host_us, 1) if name == host_row else "",
                        check=row_check.get(name, ok), gpu=target.describe()))
        print(f"B={batch:<2} L={length:<7} {name:40} {ms:8.3f} ms {gbs:7.0f} GB/s "
              f"{gbs / copy_gbs:6.1%} of copy  {base / ms:5.2f}x fa2  "
              f"{row_check.get(name, ok)}", flush=True)
    sets.clear()   # free the caches before the next size
    if torch is not None:
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--lengths", default="16384,65536,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--splits", default="", help="extra fixed num_splits to time, e.g. 8,16,32")
    ap.add_argument("--peers", type=int, default=1)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--plot", default=None, help="a PNG: GB/s against cache length, per batch")
    ap.add_argument("--only-decode", action="store_true",
                    help="decode and its CUDA-graph replay only (no split, contiguous, fa2, peers)")
    ap.add_argument("--combine", default="kernel,fused",
                    help="how the splits are merged, timed side by side: kernel (a second kernel), "
                         "fused (the split kernel's last block), or both (default)")
    ap.add_argument("--pdl", default="0",
                    help="combine=kernel launched as a programmatic dependent of the split kernel "
                         "(1), an ordinary launch (0, the default), both (0,1), or as decode "
                         "chooses (default: on from sm_90)")
    ap.add_argument("--merge-warps", default="block",
                    help="combine=kernel: the split block merges its warps (block, the default), "
                         "or each warp's part is merged by the combine kernel (combine), or both")
    args = ap.parse_args(argv)

    import common
    common.select_backend()
    import numpy as np

    from common.hardware import target
    from experiments.measure import inputs

    torch = None
    if inputs.default_library() == "torch":
        import torch
    h, h_kv, d, ps = args.heads, args.heads_kv, args.head_dim, args.page_size
    rng = np.random.default_rng(0)
    copy_gbs = copy_bandwidth(torch) if torch is not None else float("nan")
    print(f"{target.describe()} | H={h} H_kv={h_kv} d={d} bf16, one new token, pages of {ps} | "
          f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    out = []
    for batch in (int(x) for x in args.batches.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            out += measure_size(batch, length, heads=h, heads_kv=h_kv, head_dim=d, page_size=ps,
                                extra_splits=[x for x in args.splits.split(",") if x],
                                peers_on=bool(args.peers), copy_gbs=copy_gbs, rng=rng,
                                others=not args.only_decode,
                                combines=[c for c in args.combine.split(",") if c],
                                pdls=[None if x == "default" else bool(int(x))
                                      for x in args.pdl.split(",") if x],
                                merges=[m for m in args.merge_warps.split(",") if m])
    if args.plot and out:
        from experiments import plot
        plot.decode(out, args.plot)
    if args.csv and out:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(out[0]))
            writer.writeheader()
            writer.writerows(out)
    return out


if __name__ == "__main__":
    main()
