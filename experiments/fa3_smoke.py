"""One fa3 forward per head_dim and causal setting against float64 (a first look on a fresh GPU
host, seconds; also a small target for compute-sanitizer):

    python experiments/fa3_smoke.py [--seqlen 700] [--options '{"pingpong": false}'] [--head-dims 64,128]
        [--seqlen-k 300] [--window 100,0]   # N_k != N_q (causal: bottom-right), a sliding window
    compute-sanitizer --tool racecheck --racecheck-report hazard \\
        python experiments/fa3_smoke.py --seqlen 520 --sms 3      # several tiles a persistent block

--sms N launches the persistent grid as if the GPU had N SMs, so that each block loops over
several tiles (the K/V ring's phases, Q's room and the ping-pong turn carried from tile to tile).
"""
import argparse
import json

import numpy as np

import common

common.select_backend()
import variants  # noqa: E402
from common.hardware import target  # noqa: E402
from experiments.measure import checks, inputs, reference


def add_sms_option(ap):
    """--sms N: the persistent grid of at most N blocks (`cap_grid`)."""
    ap.add_argument("--sms", type=int, default=None,
                    help="persistent grid of at most this many blocks (default: the GPU's SMs)")


def cap_grid(args):
    """Launch persistent grids as if the GPU had args.sms SMs (several tiles a block)."""
    if args.sms:
        target.multiprocessor_count = lambda: args.sms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=700)
    ap.add_argument("--options", type=json.loads, default={}, help="fa3 options, JSON")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seqlen-k", type=int, default=None, help="keys (default: --seqlen)")
    ap.add_argument("--window", default="-1,-1", help="window_size left,right (-1: unbounded)")
    add_sms_option(ap)
    args = ap.parse_args(argv)
    cap_grid(args)
    rng = np.random.default_rng(0)
    window = tuple(int(x) for x in args.window.split(","))
    ok = True
    for head_dim in map(int, args.head_dims.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            q, k, v = inputs.random_qkv(rng, args.batch, args.seqlen, args.heads, head_dim,
                                        "bfloat16", seqlen_k=args.seqlen_k)
            dq, dk, dv = (inputs.to_device(x, "cupy") for x in (q, k, v))
            mask = dict(causal=causal, window_size=window)
            o, lse = variants.forward(dq, dk, dv, variant="fa3", **mask, **args.options)
            got = checks.compare(inputs.to_host(o), inputs.to_host(lse),
                                 *reference.attention(q, k, v, **mask), "bfloat16")
            print(f"fa3 d={head_dim} causal={causal} {args.options}: {got}", flush=True)
            ok &= got["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
