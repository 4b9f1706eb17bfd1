"""score_mod / mask_mod at speed: fa2 with a mod beside fa2's built-in equivalent and beside
FlexAttention (torch.compile(flex_attention)) given the same functions and its block mask.

    python experiments/mods.py [--seqlens 4096,16384] [--passes fwd,fwd_bwd] [--examples ...]
                               [--variant fa2|fa3]

Each row: bf16, d=128, 16 heads, batch 16384 / N, one example of variants/score_mods.py; times in
ms (CUDA events, interleaved rounds: common timing.interleaved) and TFLOP/s counted as the dense
(or causal) problem's FLOPs, the same count for every column, so the columns compare as times do.
`builtin` is fa2 with the built-in that computes the same thing where there is one (alibi_slopes,
causal + window_size); `plain` is fa2 with the mask alone (no score_mod, no mask_mod): the mod's
cost is mod / plain; `sdpa` is torch SDPA's flash kernel on the plain mask (the peer of `plain`);
`blockmask` is fa2 with the mod and its BlockMask (variants.block_mask: the forward and the
backward visit the kept blocks only). --variant fa3: fa3's forward in every column of ours (its
backward with a mod runs fa2's kernels, its plain and built-in ones fa3's own: fwd_bwd's
mod / plain then compares two backward kernels; no block mask: that column is left out).
Prints one table; --csv writes it.
"""
import argparse
import csv
import sys
from pathlib import Path

import numpy as np
from numba import float32

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXAMPLES = ("alibi", "document_mask", "prefix_lm", "sliding_window")
# --examples may also name alibi_int64: ALiBi written with the integer difference converted,
# float32(abs(q_idx - kv_idx)), which Numba types as int64 (variants/score_mods.py's advice, measured)


def alibi_int64(score, b, h, q_idx, kv_idx, aux):
    """score_mods.alibi as first written: the int64 difference converted once a score."""
    return score - aux[0][h] * float32(abs(q_idx - kv_idx))


def setups(torch, name, batch, heads, n, device):
    """(fa2 keywords with the mod, fa2 keywords of the built-in or None, fa2 keywords of the plain
    mask, flex score_mod, flex mask_mod, causal for the FLOP count)."""
    from variants import score_mods
    if name in ("alibi", "alibi_int64"):
        slopes = torch.tensor(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads), device=device,
                              dtype=torch.float32)
        fn = score_mods.alibi if name == "alibi" else alibi_int64
        return (dict(causal=True, score_mod=fn,
                     score_mod_grad=score_mods.unchanged_grad, aux=(slopes,)),
                dict(causal=True, alibi_slopes=slopes), dict(causal=True),
                lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), None, True)
    if name == "document_mask":   # 8 documents of random lengths, causal within each
        cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, n), 7, replace=False))
        docs = torch.tensor(np.repeat(np.arange(8), np.diff(np.concatenate([[0], cuts, [n]]))),
                            device=device, dtype=torch.int32)
        return (dict(causal=True, mask_mod=score_mods.document_mask, aux=(docs,)), None,
                dict(causal=True), None,
                lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv), True)
    if name == "prefix_lm":
        prefix = torch.full((batch,), n // 4, device=device, dtype=torch.int32)
        return (dict(mask_mod=score_mods.prefix_lm, aux=(prefix,)), None, dict(), None,
                lambda b, h, q, kv: (kv <= q) | (kv < prefix[b]), False)
    if name == "sliding_window":
        window = 1024
        w = torch.tensor([window], device=device, dtype=torch.int32)
        return (dict(mask_mod=score_mods.sliding_window, aux=(w,)),
                dict(causal=True, window_size=(window - 1, 0)), dict(causal=True), None,
                lambda b, h, q, kv: (kv <= q) & (q - kv < window), True)
    raise ValueError(f"unknown example {name!r}; these: {', '.join(EXAMPLES)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--passes", default="fwd,fwd_bwd")
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--variant", default="fa2", choices=("fa2", "fa3"))
    args = parser.parse_args(argv)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.functional import scaled_dot_product_attention

    import variants
    from experiments.measure import timing

    flex = torch.compile(flex_attention, dynamic=False)
    device, heads, d = "cuda", 16, 128
    rows = []
    for n in (int(x) for x in args.seqlens.split(",")):
        batch = max(1, 16384 // n)
        q, k, v = (torch.randn(batch, n, heads, d, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        do = torch.randn_like(q)
        qt, kt, vt, dot = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v, do))
        for name in args.examples.split(","):
            mod, builtin, plain, f_score, f_mask, causal = setups(torch, name, batch, heads, n,
                                                                  device)
            block_mask = None if f_mask is None else create_block_mask(
                f_mask, batch, heads, n, n, device=device)
            if f_mask is None and causal:
                block_mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, n, n,
                                               device=device)
            for pass_ in args.passes.split(","):
                def ours(kw):
                    def run(_):
                        o, lse = variants.forward(q, k, v, variant=args.variant, **kw)
                        if pass_ == "fwd_bwd":
                            variants.backward(do, q, k, v, o, lse, variant=args.variant, **kw)
                    return run

                def flexed(_):
                    o = flex(qt, kt, vt, score_mod=f_score, block_mask=block_mask)
                    if pass_ == "fwd_bwd":
                        torch.autograd.grad(o, (qt, kt, vt), dot)

                def sdpa_plain(_):   # the peer of `plain`: SDPA's flash kernel, the same mask
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    if pass_ == "fwd_bwd":
                        torch.autograd.grad(o, (qt, kt, vt), dot)

                fns = {"mod": ours(mod), "plain": ours(plain), "flex": flexed,
                       "sdpa": sdpa_plain}
                # and with its BlockMask (fa2's): the forward visits kept blocks
                if "mask_mod" in mod and args.variant == "fa2":
                    bm = variants.block_mask(mod["mask_mod"], n, n, aux=mod["aux"], like=q,
                                             batch=batch if name == "prefix_lm" else 1)
                    listed = dict(mod, block_mask=bm)

                    def with_bm(_, listed=listed):
                        o, lse = variants.forward(q, k, v, variant=args.variant, **listed)
                        if pass_ == "fwd_bwd":
                            variants.backward(do, q, k, v, o, lse, variant=args.variant, **listed)
                    fns["blockmask"] = with_bm
                if builtin is not None:
                    fns["builtin"] = ours(builtin)
                names = list(fns)
                got = timing.interleaved([fns[x] for x in names], rounds=args.rounds)
                flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0) * \
                    (3.5 if pass_ == "fwd_bwd" else 1.0)
                ms = {x: float(np.median([t.median_ms for t in got[i]]))
                      for i, x in enumerate(names)}
                row = dict(example=name, variant=args.variant, seqlen=n, batch=batch, pass_=pass_,
                           **{f"{x}_ms": ms[x] for x in names},
                           mod_tflops=flops / ms["mod"] / 1e9,
                           mod_over_plain=ms["mod"] / ms["plain"],
                           flex_over_mod=ms["flex"] / ms["mod"])
                if "builtin" in ms:
                    row["mod_over_builtin"] = ms["mod"] / ms["builtin"]
                if "blockmask" in ms:
                    row["flex_over_blockmask"] = ms["flex"] / ms["blockmask"]
                rows.append(row)
                print(row, flush=True)
    keys = ["example", "variant", "seqlen", "pass_", "sdpa_ms", "plain_ms", "builtin_ms", "mod_ms",
            "blockmask_ms", "flex_ms", "mod_over_plain", "mod_over_builtin", "flex_over_mod",
            "flex_over_blockmask"]
    print(" ".join(f"{k:>15s}" for k in keys))
    for r in rows:
        print(" ".join(f"{r.get(k, float('nan')):15.3f}" if not isinstance(r.get(k, 0.0), str)
                       and k not in ("seqlen",) else f"{str(r.get(k)):>15s}" for k in keys))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
