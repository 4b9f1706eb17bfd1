"""Time several fa2 (or --variant) configurations and torch SDPA's flash backend on the same tensors, in one
process (quicker than a Hydra sweep when exploring; each result is checked against float64).

    python experiments/compare_configs.py '[{}, {"hd": 128, "block_m": 128, "q_in_registers": false}]' \
        --seqlens 2048,4096 --head-dims 64,128 --causal 0,1

Each configuration is a dict of fa2 options; "hd" / "causal" keys restrict it to that head_dim /
causal setting. --peers sdpa_flash,sdpa_cudnn times those SDPA backends first (ratios to the first).
Shapes follow the FA2 paper's grid (batch * seqlen = 16k, hidden 2048), bf16 (--dtype float16 for
fp16).
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
                    help="torch SDPA backends timed first (the first is the ratios' base)")
    args = ap.parse_args(argv)

    import numpy as np

    from common import checks, flops, inputs, reference, timing
    from experiments import peers
    import variants
    module = variants.get(args.variant)

    configs = json.loads(args.configs)
    rng = np.random.default_rng(0)
    print("hd causal seqlen TFLOP/s median_ms check name")
    for hd in map(int, args.head_dims.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            for n in map(int, args.seqlens.split(",")):
                b, h = 16384 // n, 2048 // hd
                n_sets = max(1, math.ceil(128e6 / (3 * b * n * h * hd * 2)))
                hosts = [inputs.random_qkv(rng, b, n, h, hd, args.dtype) for _ in range(n_sets)]
                sets = [tuple(inputs.to_device(x, "torch") for x in host) for host in hosts]
                rows = np.unique(rng.choice(n, 64))
                ref = reference.attention(*hosts[0], causal=causal, rows=rows)
                total = flops.attention_flops(b, h, n, n, hd, causal)
                candidates = [(p, peers.forward_fn(p, causal, None, gqa=False))
                              for p in args.peers.split(",") if p]
                for options in configs:
                    options = dict(options)
                    if options.pop("hd", hd) != hd or options.pop("causal", causal) != causal:
                        continue
                    candidates.append((json.dumps(options, separators=(",", ":")),
                                       lambda q, k, v, o=options: module.forward(q, k, v, causal=causal, **o)))
                base = None
                for name, fn in candidates:
                    out = fn(*sets[0])
                    o = out[0] if isinstance(out, tuple) else out
                    ok = checks.compare(inputs.to_host(o)[:, rows], ref[1], *ref, args.dtype)["ok"]
                    t = timing.benchmark(lambda i: fn(*sets[i % len(sets)]), warmup=3, target_ms=200)
                    tflops = total / t.median_ms / 1e9
                    base = base or tflops
                    print(f"{hd} {int(causal)} {n} {tflops:.1f} ({tflops / base:.2f}) {t.median_ms:.4f} "
                          f"{'ok' if ok else 'FAIL'} {name}", flush=True)


if __name__ == "__main__":
    main()
