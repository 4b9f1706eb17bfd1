"""What the masks cost (issue: the shapes and masks real models use), on one GPU in one run.

    python experiments/masks.py [--seqlen 32768] [--window 4096] [--variant fa2] [--csv PATH]

Rows, each checked against float64 on sampled rows, then timed (CUDA events, median):
- full: non-causal attention over the whole sequence; causal; window_size=(W, 0) (a query sees
  itself and the W keys before it). The bar: the window's time <= 1.2 * (W / N) * full's time,
  i.e. the blocks outside the window are skipped, not masked (`window / full` column).
- softcap=30 on the causal problem (Gemma 2's tanh on every score): its cost over plain causal.
- a rectangle: N/4 queries against N keys, bottom-right causal (a chunk of prefill over a cache).
- peers where torch has them: SDPA flash (full, causal: its causal is top-left, equal on a
  square), and FlexAttention with a sliding-window block mask (if torch.compile runs it here).
TFLOP/s count the (query, key) pairs each mask keeps (experiments/measure/flops.py: visible_pairs), so a
skipped block is not counted as work.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variant", default="fa2")
    ap.add_argument("--passes", default="fwd,fwd_bwd")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (torch.compile)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    import variants
    from common.hardware import target
    from common.tile import masks
    from experiments import peers, write_rows
    from experiments.measure import checks, flops, inputs, reference, timing

    n, w, h, d = args.seqlen, args.window, args.heads, args.head_dim
    rng = np.random.default_rng(0)
    host = inputs.random_qkv(rng, 1, n, h, d, "bfloat16")
    do_host = rng.standard_normal(host[0].shape, dtype=np.float32).astype(host[0].dtype)
    dev = [inputs.to_device(x, "torch") for x in host]
    do = inputs.to_device(do_host, "torch")
    rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, 24, replace=False)]))
    module = variants.get(args.variant)
    print(f"{target.describe()} | B=1 H={h} N={n} d={d} bf16 | {args.variant}", flush=True)

    cases = [("full", dict(), n), ("causal", dict(causal=True), n),
             (f"window({w},0)", dict(window_size=(w, 0)), n),
             (f"causal+window({w},0)", dict(causal=True, window_size=(w, 0)), n),
             ("causal+softcap30", dict(causal=True, softcap=30.0), n),
             ("rect causal N/4 x N", dict(causal=True), n // 4)]
    out, ms_of = [], {}
    for pass_ in args.passes.split(","):
        for name, mask, n_q in cases:
            q = dev[0][:, n - n_q:]   # the last n_q queries: bottom-right causal is their own mask
            qh = host[0][:, n - n_q:]
            band = masks.band(mask.get("causal", False), mask.get("window_size", (-1, -1)),
                              masks.BOTTOM_RIGHT, n_q, n, 0.0, 1.0)
            total = flops.attention_flops(1, h, n_q, n, d, mode=pass_,
                                          pairs=flops.visible_pairs(n_q, n, band))
            r = rows[rows < n_q]
            ref = reference.attention(qh, *host[1:], rows=r, **mask)

            def fwd(i, q=q, mask=mask):
                return module.forward(q, dev[1], dev[2], **mask)

            def fwd_bwd(i, q=q, mask=mask):
                o, lse = module.forward(q, dev[1], dev[2], **mask)
                return o, lse, module.backward(do[:, n - n_q:], q, dev[1], dev[2], o, lse, **mask)

            fn = fwd if pass_ == "fwd" else fwd_bwd
            try:
                o, lse = fn(0)[:2]
            except ValueError as e:   # a mask the variant does not take: skipped, named
                if not any(w in str(e) for w in ("softcap", "window", "causal")):
                    raise
                print(f"{pass_:8} {name:24} refused: {e}", flush=True)
                continue
            got = checks.compare(inputs.to_host(o)[:, r], inputs.to_host(lse)[:, :, r], *ref,
                                 "bfloat16")
            t = timing.benchmark(fn, warmup=2, min_reps=5, max_reps=50, target_ms=400)
            ms_of[pass_, name] = t.median_ms
            out.append(dict(kernel=args.variant, case=name, pass_=pass_, seqlen_q=n_q, seqlen_k=n,
                            heads=h, head_dim=d, ms=round(t.median_ms, 4),
                            tflops=round(total / t.median_ms / 1e9, 1),
                            check="ok" if got["ok"] else "FAIL", gpu=target.describe()))
            print(f"{pass_:8} {name:24} {t.median_ms:9.3f} ms {out[-1]['tflops']:7.1f} TFLOP/s  "
                  f"{out[-1]['check']}", flush=True)
            del o, lse
        # peers on the same tensors
        for peer, causal in (("sdpa_flash", False), ("sdpa_flash", True)):
            f = peers.forward_fn(peer, causal, None, gqa=False)
            total = flops.attention_flops(1, h, n, n, d, causal, pass_)
            leaves = [x.detach().requires_grad_(pass_ != "fwd") for x in dev]

            def peer_fn(i, f=f, leaves=leaves):
                if pass_ == "fwd":
                    with torch.no_grad():
                        return f(*leaves)
                return torch.autograd.grad(f(*leaves), leaves, do)

            t = timing.benchmark(peer_fn, warmup=2, min_reps=5, max_reps=50, target_ms=400)
            name = f"{peer} {'causal' if causal else 'full'}"
            out.append(dict(kernel=peer, case="causal" if causal else "full", pass_=pass_,
                            seqlen_q=n, seqlen_k=n, heads=h, head_dim=d, ms=round(t.median_ms, 4),
                            tflops=round(total / t.median_ms / 1e9, 1), check="",
                            gpu=target.describe()))
            print(f"{pass_:8} {name:24} {t.median_ms:9.3f} ms {out[-1]['tflops']:7.1f} TFLOP/s",
                  flush=True)
        if not args.no_flex:
            out += flex_rows(dev, do, n, w, h, d, pass_)

    print("\nwindow / full (bar: <= 1.2 x W/N = %.3f):" % (1.2 * w / n))
    for pass_ in args.passes.split(","):
        ratio = ms_of.get((pass_, f"window({w},0)"), math.nan) / ms_of[pass_, "full"]
        soft = ms_of.get((pass_, "causal+softcap30"), math.nan) / ms_of[pass_, "causal"]
        print(f"  {pass_:8} window/full {ratio:.3f} ({ratio / (w / n):.2f} x W/N)   "
              f"softcap/causal {soft:.3f}")
    if args.csv:
        write_rows(args.csv, out)


def flex_rows(dev, do, n, w, h, d, pass_):
    """FlexAttention (torch.compile'd) with a sliding-window block mask, if it runs here."""
    import torch

    from common.hardware import target
    from common.tile import masks
    from experiments.measure import flops, timing
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = create_block_mask(lambda b, hh, qi, ki: (ki <= qi) & (qi - ki <= w),
                                       None, None, n, n, device="cuda")
        leaves = [x.detach().transpose(1, 2).requires_grad_(pass_ != "fwd") for x in dev]
        dot = do.transpose(1, 2)

        def fn(i):
            if pass_ == "fwd":
                with torch.no_grad():
                    return compiled(*leaves, block_mask=block_mask)
            return torch.autograd.grad(compiled(*leaves, block_mask=block_mask), leaves, dot)

        t = timing.benchmark(fn, warmup=2, min_reps=5, max_reps=50, target_ms=400)
    except Exception as exc:   # no triton, no compiler: say so, keep the other rows
        print(f"{pass_:8} flex_attention window: not run ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:120] if str(exc) else ''})", flush=True)
        return []
    band = masks.band(True, (w, 0), masks.BOTTOM_RIGHT, n, n, 0.0, 1.0)
    total = flops.attention_flops(1, h, n, n, d, mode=pass_, pairs=flops.visible_pairs(n, n, band))
    print(f"{pass_:8} {'flex causal+window':24} {t.median_ms:9.3f} ms "
          f"{total / t.median_ms / 1e9:7.1f} TFLOP/s", flush=True)
    return [dict(kernel="flex_attention", case=f"causal+window({w},0)", pass_=pass_, seqlen_q=n,
                 seqlen_k=n, heads=h, head_dim=d, ms=round(t.median_ms, 4),
                 tflops=round(total / t.median_ms / 1e9, 1), check="", gpu=target.describe())]


if __name__ == "__main__":
    main()
