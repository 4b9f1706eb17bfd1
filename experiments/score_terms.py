"""What the score terms cost (issue 59): ALiBi and attention sinks against the plain kernel, forward
and forward + backward, in one run on one GPU.

    python experiments/score_terms.py [--variants fa3,fa2] [--seqlens 4096,16384] [--csv PATH]

bf16, d=128, the FA2 paper's shapes (batch = 16k / N, 16 heads), causal and not. For each
(variant, N, causal, pass) the plain call, alibi_slopes (ALiBi's geometric slopes) and sinks are
each checked against float64 on sampled rows, then timed interleaved round by round
(experiments/measure/timing.py: interleaved), so that each ratio to plain compares calls made
under the same clocks. The bars (issue 59): ALiBi <= 5% and sinks <= 3% of forward + backward.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="fa3")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--passes", default="fwd,fwd_bwd")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    import numpy as np

    import variants
    from common.hardware import target
    from experiments import write_rows
    from experiments.measure import checks, flops, inputs, reference, timing

    d, heads = args.head_dim, 16
    rng = np.random.default_rng(0)
    slopes = inputs.alibi_slopes(heads)
    sinks = rng.standard_normal(heads).astype(np.float32)
    terms_host = {"plain": {}, "alibi": dict(alibi_slopes=slopes), "sinks": dict(sinks=sinks)}
    terms = {name: {k: inputs.to_device(x, "torch") for k, x in t.items()}
             for name, t in terms_host.items()}
    print(f"{target.describe()} | bf16 d={d} H={heads} | ALiBi and sinks against plain",
          flush=True)
    out = []
    for variant in args.variants.split(","):
        module = variants.get(variant)
        for n in (int(x) for x in args.seqlens.split(",")):
            batch = max(1, 16384 // n)
            host = inputs.random_qkv(rng, batch, n, heads, d, "bfloat16")
            do_host = rng.standard_normal(host[0].shape, dtype=np.float32).astype(host[0].dtype)
            q, k, v = (inputs.to_device(x, "torch") for x in host)
            do = inputs.to_device(do_host, "torch")
            rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, 16, replace=False)]))
            for causal in (False, True):
                for pass_ in args.passes.split(","):
                    fns = []
                    for name in terms:
                        kw = dict(causal=causal, **terms[name])

                        def fwd(i, kw=kw):
                            return module.forward(q, k, v, **kw)

                        def fwd_bwd(i, kw=kw):
                            o, lse = module.forward(q, k, v, **kw)
                            return module.backward(do, q, k, v, o, lse, **kw)

                        o, lse = fwd(0)
                        ref = reference.attention(host[0][:1], host[1][:1], host[2][:1],
                                                  rows=rows, causal=causal,
                                                  **terms_host[name])
                        got = checks.compare(inputs.to_host(o)[:1, rows],
                                             inputs.to_host(lse)[:1, :, rows], *ref, "bfloat16")
                        if not got["ok"]:
                            raise AssertionError(f"{variant} {name} N={n} causal={causal}: "
                                                 + checks.describe_failure(got))
                        fns.append(fwd if pass_ == "fwd" else fwd_bwd)
                    rounds = timing.interleaved(fns, rounds=args.rounds)
                    total = flops.attention_flops(batch, heads, n, n, d, causal, pass_)
                    plain = [t.median_ms for t in rounds[0]]
                    for name, timed in zip(terms, rounds):
                        ms = statistics.median(t.median_ms for t in timed)
                        ratio = statistics.median(t.median_ms / p for t, p in zip(timed, plain))
                        out.append(dict(variant=variant, seqlen=n, batch=batch, causal=causal,
                                        pass_=pass_, case=name, ms=round(ms, 4),
                                        tflops=round(total / ms / 1e9, 1),
                                        over_plain=round(ratio, 4), gpu=target.describe()))
                        print(f"{variant} N={n:6} causal={causal!s:5} {pass_:8} {name:6} "
                              f"{ms:9.3f} ms {out[-1]['tflops']:7.1f} TFLOP/s  x{ratio:.3f} of "
                              "plain", flush=True)
    print("\ncost over plain (bars: alibi <= 1.05, sinks <= 1.03 of fwd_bwd)")
    for r in out:
        if r["case"] != "plain":
            print(f"  {r['variant']} N={r['seqlen']:6} causal={r['causal']!s:5} {r['pass_']:8} "
                  f"{r['case']:6} x{r['over_plain']:.3f}")
    if args.csv:
        write_rows(args.csv, out)


if __name__ == "__main__":
    main()
