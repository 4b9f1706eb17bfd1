"""What the score terms and dropout cost (issue 59): ALiBi, attention sinks and dropout on P against
the plain kernel, forward and forward + backward, in one run on one GPU.

    python experiments/score_terms.py [--variants fa3,fa2] [--seqlens 4096,16384]
        [--cases plain,alibi,sinks,dropout] [--csv PATH]

bf16, d=128, the FA2 paper's shapes (batch = 16k / N, 16 heads), causal and not. For each
(variant, N, causal, pass) the plain call, alibi_slopes (ALiBi's geometric slopes), sinks and
dropout_p=0.1 (fa2 only: FA3 has no dropout) are each checked against float64 on sampled rows
(dropout: with the kernels' mask, common/tile/dropout.py), then timed interleaved round by round
(experiments/measure/timing.py: interleaved), so that each ratio to plain compares calls made
under the same clocks; with dropout, SDPA's flash backend with and without its own dropout beside
them (`sdpa`, `sdpa_dropout`: what dropout costs FlashAttention-2 itself). The bars (issue 59):
ALiBi <= 5%, sinks <= 3%, dropout <= 15% of forward + backward.
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
    ap.add_argument("--cases", default="plain,alibi,sinks")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    import numpy as np

    import variants
    from common.hardware import target
    from common.tile import dropout
    from experiments import write_rows
    from experiments.measure import checks, flops, inputs, reference, timing

    d, heads = args.head_dim, 16
    rng = np.random.default_rng(0)
    slopes = inputs.alibi_slopes(heads)
    sinks = rng.standard_normal(heads).astype(np.float32)
    p, seed = args.dropout, 2026
    terms_host = {"plain": {}, "alibi": dict(alibi_slopes=slopes), "sinks": dict(sinks=sinks)}
    terms = {name: {k: inputs.to_device(x, "torch") for k, x in t.items()}
             for name, t in terms_host.items()}
    terms["dropout"] = dict(dropout_p=p, dropout_seed=seed, dropout_offset=0)
    cases = args.cases.split(",")
    print(f"{target.describe()} | bf16 d={d} H={heads} | {', '.join(cases[1:])} against plain",
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
                    names = [c for c in cases if c != "dropout" or variant == "fa2"]
                    for name in names:
                        kw = dict(causal=causal, **terms[name])

                        def fwd(i, kw=kw):
                            return module.forward(q, k, v, **kw)

                        def fwd_bwd(i, kw=kw):
                            o, lse = module.forward(q, k, v, **kw)
                            return module.backward(do, q, k, v, o, lse, **kw)

                        o, lse = fwd(0)
                        ref_terms = dict(terms_host.get(name, {}))
                        if name == "dropout":   # batch 0's mask at the checked rows
                            ref_terms = dict(dropout_p=p, dropout_mask=dropout.keep_mask(
                                seed, 0, p, batch, heads, n, n, rows=rows, batches=[0]))
                        ref = reference.attention(host[0][:1], host[1][:1], host[2][:1],
                                                  rows=rows, causal=causal, **ref_terms)
                        got = checks.compare(inputs.to_host(o)[:1, rows],
                                             inputs.to_host(lse)[:1, :, rows], *ref, "bfloat16")
                        if not got["ok"]:
                            raise AssertionError(f"{variant} {name} N={n} causal={causal}: "
                                                 + checks.describe_failure(got))
                        fns.append(fwd if pass_ == "fwd" else fwd_bwd)
                    if "dropout" in names:   # FlashAttention-2's own dropout cost, beside ours
                        for drop_p in (0.0, p):
                            names.append("sdpa" if not drop_p else "sdpa_dropout")
                            fns.append(sdpa_call(q, k, v, do, causal, drop_p, pass_))
                    rounds = timing.interleaved(fns, rounds=args.rounds)
                    total = flops.attention_flops(batch, heads, n, n, d, causal, pass_)
                    plain = [t.median_ms for t in rounds[0]]
                    if "sdpa" in names:   # SDPA's dropout against SDPA's own plain call
                        base = [t.median_ms for t in rounds[names.index("sdpa")]]
                    for name, timed in zip(names, rounds):
                        ref_ms = base if name == "sdpa_dropout" else plain
                        ms = statistics.median(t.median_ms for t in timed)
                        ratio = statistics.median(t.median_ms / b for t, b in zip(timed, ref_ms))
                        out.append(dict(variant=variant, seqlen=n, batch=batch, causal=causal,
                                        pass_=pass_, case=name, ms=round(ms, 4),
                                        tflops=round(total / ms / 1e9, 1),
                                        over_plain=round(ratio, 4), gpu=target.describe()))
                        print(f"{variant} N={n:6} causal={causal!s:5} {pass_:8} {name:6} "
                              f"{ms:9.3f} ms {out[-1]['tflops']:7.1f} TFLOP/s  x{ratio:.3f} of "
                              "plain", flush=True)
    print("\ncost over plain (bars: alibi <= 1.05, sinks <= 1.03, dropout <= 1.15 of fwd_bwd; "
          "sdpa_dropout: over sdpa)")
    for r in out:
        if r["case"] not in ("plain", "sdpa"):
            print(f"  {r['variant']} N={r['seqlen']:6} causal={r['causal']!s:5} {r['pass_']:8} "
                  f"{r['case']:6} x{r['over_plain']:.3f}")
    if args.csv:
        write_rows(args.csv, out)


def sdpa_call(q, k, v, do, causal, dropout_p, pass_):
    """SDPA's flash backend (FlashAttention-2's kernels) on the same tensors, with dropout_p."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)

    def call(i):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, dropout_p=dropout_p,
                                                                 is_causal=causal)
            if pass_ == "fwd":
                return o
            return torch.autograd.grad(o, (qt, kt, vt), dot)
    return call


if __name__ == "__main__":
    main()
