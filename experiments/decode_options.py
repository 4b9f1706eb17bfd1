"""What flash_attn_with_kvcache's options cost the decode kernel (issue 62), one GPU, one run:

    python experiments/decode_options.py [--batch 8] [--lengths 16384,32768] [--head-dims 128,256]
                                         [--csv PATH]

One new token a sequence (q (B, 1, 32, d), bf16) against contiguous caches of L tokens a sequence
(8 K/V heads), causal. Each row is variants.decode with one option on, replayed from a CUDA graph
(the kernels without the host's time), timed with CUDA events (median), beside the plain call in
the same run; every option is set so that it reads the same keys as the plain call (left padding
0, a window over every key) and so measures its arithmetic alone:
- plain; leftpad (cache_leftpad = 0); window (window_size = (L - 1, 0)); softcap (30); alibi ((H,)
  slopes); batch_idx (rows reversed); rotary (RoPE tables of rotary_dim = d, the call rotating q);
- window_half: window_size = (L / 2, 0), half the keys: what skipping the keys left of the window
  buys (the bar: about 2x);
- and a device-to-device copy of 2 GiB, whose rate (read + written) is the bandwidth ceiling.
GB/s = K and V bytes the call reads / time; `vs plain` is the option's time over plain's (the bar:
<= 1.05 at batch 8, 16k; d=256 >= 85% of the copy rate at batch 8, 32k).

--prefill: a chunked prefill against a paged cache (flash_attn_varlen_func's block_table: fa2's
forward, pages of 64, 128 and 256 keys, a shuffled table) beside the same packed batch with its
keys contiguous (8 sequences, a chunk of 1024 new queries each against 8k keys, causal, GQA
32/8, d=128, bf16); the bar: paged within 10% of contiguous at pages >= 64.
"""
import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("plain", "leftpad", "window", "softcap", "alibi", "batch_idx", "rotary", "window_half")


def case_options(torch, case, batch, length, heads, head_dim, like):
    """The decode keywords of one case."""
    if case == "leftpad":
        return dict(cache_leftpad=torch.zeros(batch, dtype=torch.int32, device="cuda"))
    if case == "window":   # every key (a side as long as the cache would be no window at all)
        return dict(window_size=(length - 1, 0))
    if case == "window_half":
        return dict(window_size=(length // 2, 0))
    if case == "softcap":
        return dict(softcap=30.0)
    if case == "alibi":
        return dict(alibi_slopes=torch.rand(heads, device="cuda", dtype=torch.float32))
    if case == "batch_idx":
        return dict(cache_batch_idx=torch.arange(batch - 1, -1, -1, dtype=torch.int32,
                                                 device="cuda"))
    if case == "rotary":
        angle = torch.rand(length + 1, head_dim // 2, device="cuda") * 6.28
        return dict(rotary_cos=angle.cos().to(like.dtype), rotary_sin=angle.sin().to(like.dtype))
    return {}


def measure(batch, length, head_dim, copy_gbs, heads=32, heads_kv=8):
    import torch

    from experiments.measure import timing
    from variants import decoding
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, length, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = decoding.num_splits_heuristic(batch, heads_kv, length, sms, decoding.Config.block_n)
    rows = []
    for case in CASES:
        kw = case_options(torch, case, batch, length, heads, head_dim, q)

        def call(i, kw=kw):
            return decoding.decode(q, k, v, lens, causal=True, check=False, num_splits=splits,
                                   **kw)
        call(0)
        graph, _ = timing.capture_cuda_graph(lambda: call(0))
        ms = timing.benchmark(lambda i: graph.replay(), warmup=3, min_reps=20, max_reps=400,
                              target_ms=150).median_ms
        read = k.numel() * 2 * 2 * (0.5 if case == "window_half" else 1.0)
        rows.append(dict(head_dim=head_dim, batch=batch, length=length, case=case, splits=splits,
                         ms=round(ms, 4), gbs=round(read / ms / 1e6, 1),
                         of_copy=round(read / ms / 1e6 / copy_gbs, 3)))
    plain = rows[0]["ms"]
    for r in rows:
        r["vs_plain"] = round(r["ms"] / plain, 3)
    return rows


def prefill_rows(pages=(64, 128, 256), batch=8, chunk=1024, keys=8192, heads=32, heads_kv=8,
                 head_dim=128):
    """Paged against contiguous varlen forwards (CUDA events, median, eager calls)."""
    import torch

    from experiments.measure import timing
    from variants import flash_attn
    q = torch.randn(batch * chunk, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch * keys, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * chunk
    cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * keys
    run = dict(causal=True, variant="fa2")
    with torch.no_grad():
        ms = timing.benchmark(lambda i: flash_attn.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, chunk, keys, **run), min_reps=10, max_reps=100).median_ms
        rows = [dict(case="contiguous", page_size=0, ms=round(ms, 4), vs_contiguous=1.0)]
        for size in pages:
            per_seq = keys // size
            perm = torch.randperm(batch * per_seq, device="cuda")
            table = perm.reshape(batch, per_seq).to(torch.int32)
            kc, vc = (torch.empty(batch * per_seq, size, heads_kv, head_dim, device="cuda",
                                  dtype=torch.bfloat16) for _ in "kv")
            kc[perm.long()] = k.view(batch * per_seq, size, heads_kv, head_dim)
            vc[perm.long()] = v.view(batch * per_seq, size, heads_kv, head_dim)
            paged = timing.benchmark(lambda i: flash_attn.flash_attn_varlen_func(
                q, kc, vc, cu_q, cu_k, chunk, keys, block_table=table, **run),
                min_reps=10, max_reps=100).median_ms
            rows.append(dict(case="paged", page_size=size, ms=round(paged, 4),
                             vs_contiguous=round(paged / ms, 3)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--prefill", action="store_true", help="paged prefill against contiguous")
    args = ap.parse_args(argv)
    import torch

    from experiments.decode import copy_bandwidth
    copy_gbs = copy_bandwidth(torch)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + written)", flush=True)
    if args.prefill:   # first: two kernels to compile, where the options' table has sixteen
        print("== chunked prefill (fa2 varlen forward): paged against contiguous", flush=True)
        for r in prefill_rows():
            print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for length in map(int, args.lengths.split(",")):
            got = measure(args.batch, length, d, copy_gbs)
            if not rows:
                print(" ".join(f"{k:>10}" for k in got[0]), flush=True)
            for r in got:   # each (head dim, length) as it is measured: a time limit keeps them
                print(" ".join(f"{r[k]!s:>10}" for k in r), flush=True)
            rows += got
            if args.csv:
                with open(args.csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)


if __name__ == "__main__":
    main()
