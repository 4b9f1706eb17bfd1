"""What a packed batch of sequences costs (issue: the shapes real models use), on one GPU in one run.

    python experiments/varlen.py [--lengths 100,300,517,1000,2048,3000,4096,8192] [--heads 16]
                                 [--head-dim 128] [--causal 0,1] [--csv PATH]

For each causal setting, each checked against float64 on sampled rows of every sequence, then timed
(CUDA events, median):
- varlen: one `forward_varlen` call over the packed batch (q, k, v of shape (total, H, d));
- singles: each sequence alone (`forward` with batch 1), timed one by one, summed;
- padded: one `forward` over the batch padded to the longest sequence (the work varlen avoids).
The bar: varlen <= 1.1 x singles (no padding work, and no more than a launch's worth of overhead
per sequence). TFLOP/s count each sequence's own (query, key) pairs.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="100,300,517,1000,2048,3000,4096,8192")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--variant", default="fa2")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    import common
    common.select_backend()
    import numpy as np

    import variants
    from common.hardware import target
    from experiments import write_rows
    from experiments.measure import checks, flops, inputs, reference, timing

    lengths = [int(x) for x in args.lengths.split(",")]
    h, d, dtype = args.heads, args.head_dim, "bfloat16"
    rng = np.random.default_rng(0)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (x[0] for x in inputs.random_qkv(rng, 1, int(cu[-1]), h, d, dtype))
    library = inputs.default_library()
    dq, dk, dv, dcu = (inputs.to_device(x, library) for x in (q, k, v, cu))
    singles = [tuple(inputs.to_device(np.ascontiguousarray(x[None, cu[b]:cu[b + 1]]), library)
                     for x in (q, k, v)) for b in range(len(lengths))]
    longest = max(lengths)
    padded = np.zeros((len(lengths), longest, h, d), dtype=q.dtype)
    for b, n in enumerate(lengths):
        padded[b, :n] = q[cu[b]:cu[b + 1]]
    dpad = inputs.to_device(padded, library)
    module = variants.get(args.variant)
    print(f"{target.describe()} | lengths {lengths} | H={h} d={d} bf16 | {args.variant}",
          flush=True)
    bench = dict(warmup=2, min_reps=5, max_reps=50, target_ms=300)

    out = []
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        total = sum(flops.attention_flops(1, h, n, n, d, causal) for n in lengths)

        def varlen(i, causal=causal):
            return variants.forward_varlen(dq, dk, dv, dcu, dcu, longest, longest,
                                           variant=args.variant, causal=causal)

        o, lse = varlen(0)
        o, lse = inputs.to_host(o), inputs.to_host(lse)
        ok = True
        for b, n in enumerate(lengths):
            rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, min(n, 16), replace=False)]))
            s = slice(cu[b], cu[b + 1])
            ref = reference.attention(q[None, s], k[None, s], v[None, s], causal=causal, rows=rows)
            got = checks.compare(o[None, s][:, rows], lse[None, :, s][:, :, rows], *ref, dtype)
            ok &= bool(got["ok"])
        t_var = timing.benchmark(varlen, **bench).median_ms
        t_one = [timing.benchmark(lambda i, x=x: module.forward(*x, causal=causal),
                                  **bench).median_ms for x in singles]
        t_pad = timing.benchmark(lambda i: module.forward(dpad, dpad, dpad, causal=causal),
                                 **bench).median_ms
        rows = [("varlen", t_var), ("singles (sum)", sum(t_one)), ("padded", t_pad)]
        for name, ms in rows:
            out.append(dict(kernel=args.variant, case=name, causal=causal, lengths=args.lengths,
                            heads=h, head_dim=d, ms=round(ms, 4),
                            tflops=round(total / ms / 1e9, 1), check="ok" if ok else "FAIL",
                            gpu=target.describe()))
            print(f"causal={causal!s:5} {name:14} {ms:9.3f} ms {out[-1]['tflops']:7.1f} TFLOP/s"
                  f"  {out[-1]['check'] if name == 'varlen' else ''}", flush=True)
        print(f"causal={causal!s:5} varlen / singles = {t_var / sum(t_one):.3f} (bar <= 1.10); "
              f"singles: " + ", ".join(f"{n}: {ms:.3f}" for n, ms in zip(lengths, t_one)),
              flush=True)
    if args.csv:
        write_rows(args.csv, out)


if __name__ == "__main__":
    main()
