"""Time several fa2 (or --variant) configurations and torch SDPA's flash backend on the same tensors, in one
process (quicker than a Hydra sweep when exploring; each result is checked against float64).

    python experiments/compare_configs.py '[{}, {"hd": 128, "block_m": 128, "q_in_registers": false}]' \
        --seqlens 2048,4096 --head-dims 64,128 --causal 0,1

Each configuration is a dict of fa2 options; "hd" / "causal" keys restrict it to that head_dim /
causal setting. --peers sdpa_flash,sdpa_cudnn times those SDPA backends too, listed first (ratios
to the first). Shapes follow the FA2 paper's grid (batch * seqlen = 16k, hidden 2048), bf16
(--dtype float16 for fp16).

A shape's peers and configurations are timed together in --rounds interleaved rounds (default 5;
`timing.interleaved`: each round's order a Williams design's, since what runs just before a kernel
moves its time, docs/performance/fp8.md, "FP8 tiles between panels"): TFLOP/s and median_ms are
medians over the rounds, the ratio in brackets the median of the rounds' ratios to the first row;
a comment line after each shape gives each row's TFLOP/s round by round and the range of its
ratio.

--pass bwd times the backward alone instead (the configurations are the variant's backward
options; o and lse from fa2's forward, made once), the papers' FLOPs (2.5x the forward's); each
configuration's gradients are checked against fa2's backward on the same tensors (max error within
2^-6 of the largest gradient: a wrong kernel is far off), the peers' backward timed by autograd.

    python experiments/compare_configs.py '[{}, {"kernel": "fa2"}]' --variant fa3 --pass bwd
"""
import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.select_backend()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", help="JSON list of fa2 option dicts ({} = the defaults)")
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--variant", default="fa2")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--peers", default="sdpa_flash",
                    help="torch SDPA backends, listed first (the first is the ratios' base)")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (timing.interleaved)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")

    import numpy as np

    import variants
    from experiments import peers
    from experiments.measure import checks, flops, inputs, reference
    module = variants.get(args.variant)

    configs = json.loads(args.configs)
    rng = np.random.default_rng(0)
    print(f"# {args.rounds} interleaved rounds; TFLOP/s, median_ms: medians over the rounds; "
          "(x the first row): median of the rounds' ratios")
    print("hd causal seqlen TFLOP/s median_ms check name")
    for hd in map(int, args.head_dims.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            for n in map(int, args.seqlens.split(",")):
                b, h = 16384 // n, 2048 // hd
                n_sets = max(1, math.ceil(128e6 / (3 * b * n * h * hd * 2)))
                hosts = [inputs.random_qkv(rng, b, n, h, hd, args.dtype) for _ in range(n_sets)]
                sets = [tuple(inputs.to_device(x, "torch") for x in host) for host in hosts]
                total = flops.attention_flops(b, h, n, n, hd, causal)
                if args.pass_ == "bwd":
                    backward_configs(args, module, configs, sets, causal, hd, n, 2.5 * total)
                    continue
                rows = np.unique(rng.choice(n, 64))
                ref = reference.attention(*hosts[0], causal=causal, rows=rows)
                candidates = [(p, peers.forward_fn(p, causal, None, gqa=False))
                              for p in args.peers.split(",") if p]
                for options in configs:
                    options = dict(options)
                    if options.pop("hd", hd) != hd or options.pop("causal", causal) != causal:
                        continue
                    candidates.append((json.dumps(options, separators=(",", ":")),
                                       lambda q, k, v, o=options: module.forward(q, k, v, causal=causal, **o)))
                checked = []
                for name, fn in candidates:
                    out = fn(*sets[0])
                    o = out[0] if isinstance(out, tuple) else out
                    ok = checks.compare(inputs.to_host(o)[:, rows], ref[1], *ref, args.dtype)["ok"]
                    checked.append((name, lambda i, fn=fn: fn(*sets[i % len(sets)]), ok))
                timed_rows(checked, total, f"{hd} {int(causal)} {n}", args.rounds)


def backward_configs(args, module, configs, sets, causal, hd, n, total):
    """--pass bwd: the peers' backward and each backward configuration of `module`, timed on the
    same tensors (o, lse from fa2's forward, dO random), checked against fa2's backward."""
    import torch

    import variants
    from experiments import peers
    dos = [torch.randn_like(s[0]) for s in sets]
    outs = [variants.forward(*s, variant="fa2", causal=causal) for s in sets]
    ref = [x.float() for x in variants.backward(dos[0], *sets[0], *outs[0], variant="fa2",
                                                 causal=causal)]
    candidates = []
    for p in args.peers.split(","):
        if p:
            fn = peers.pass_fn("bwd", peers.forward_fn(p, causal, None, gqa=False),
                               [s + (d,) for s, d in zip(sets, dos)])
            fn.prime()
            candidates.append((p, lambda i, fn=fn: fn(i)[2]))
    for options in configs:
        options = dict(options)
        if options.pop("hd", hd) != hd or options.pop("causal", causal) != causal:
            continue
        candidates.append((json.dumps(options, separators=(",", ":")),
                           lambda i, o=options: module.backward(
                               dos[i % len(sets)], *sets[i % len(sets)], *outs[i % len(sets)],
                               causal=causal, **o)))
    checked = []
    for name, fn in candidates:
        got = [x.float() for x in fn(0)]
        ok = all(float((g - r).abs().max()) <= 2 ** -6 * float(r.abs().max())
                 for g, r in zip(got, ref))
        checked.append((name, fn, ok))
    timed_rows(checked, total, f"{hd} {int(causal)} {n}", args.rounds)


def timed_rows(checked, total, shape, rounds):
    """Time the (name, fn(i), check passed) of one shape together in interleaved rounds
    (`timing.interleaved`) and print a row each: TFLOP/s and ms the medians over the rounds, the
    ratio to the first row (in brackets) the median of the rounds' ratios, each taken within its
    round; then, as comments, each row's TFLOP/s round by round and its ratio's range."""
    import statistics

    from experiments.measure import timing
    if not checked:
        return
    per = [[t.median_ms for t in r]
           for r in timing.interleaved([fn for _, fn, _ in checked], rounds=rounds)]
    for (name, _, ok), ms in zip(checked, per):
        ratio = statistics.median(b / a for a, b in zip(ms, per[0]))
        median_ms = statistics.median(ms)
        print(f"{shape} {total / median_ms / 1e9:.1f} ({ratio:.2f}) {median_ms:.4f} "
              f"{'ok' if ok else 'FAIL'} {name}", flush=True)
    for (name, _, _), ms in zip(checked, per):   # every round, for the record
        ratios = [b / a for a, b in zip(ms, per[0])]
        print(f"#   {shape} rounds {' '.join(f'{total / x / 1e9:.0f}' for x in ms)}  "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] {name}", flush=True)


if __name__ == "__main__":
    main()
