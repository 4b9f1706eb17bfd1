"""fa3 in FP8: the FA3 paper's accuracy table (Table 3) and FP8's speed against fa3 in bf16 and the
SDPA peers, each one command, on the GPU (the accuracy table also runs in the simulator, small).

    python experiments/fp8.py accuracy [--seqlen 4096] [--csv out.csv]
    python experiments/fp8.py speed [--seqlens 1024,...,16384] [--causal 0,1] [--head-dim 128|256] [--rounds 3] [--csv out.csv]
    python experiments/fp8.py configs '[{}, {"intra_overlap": true}]' [--seqlens ...] [--causal ...] [--rounds 5]
    python experiments/fp8.py figure SPEED.csv ACCURACY.csv OUT.png   (needs matplotlib)

accuracy: RMSE of O against float64 attention over the fp16 inputs, for Q, K, V ~ N(0, 1) and
N(0, 1) + N(0, 100) Bernoulli(0.001) (0.1% outliers of standard deviation 10: the paper's
setting), for fa3 fp16, FP8 with one scale a tensor, FP8 + block quantisation (a scale per 256
rows of Q and K, fp8.DEFAULT_BLOCK; per head for V), FP8 + incoherent processing (random signs x Hadamard on Q and
K), FP8 + both — next to the paper's numbers.

speed: the FA2 paper's grid (batch x seqlen = 16k, 16 heads of 128, bf16 inputs), forward
TFLOP/s of sdpa_flash, sdpa_cudnn, fa3 bf16, and fa3 FP8 with one scale a head:
  "fp8"          V in flash_attn's layout, so the call includes V's K-major pre-pass (`v_k_major`);
  "fp8 V^T"      V handed over K-major (`fp8.KMajorV`, as `quantize_fp8(v, block=None,
                 k_major=True)` writes it): no pre-pass, the kernel alone;
  "fp8 in-kern"  V transposed by the kernel's producer instead (transpose_v="producer"; d=128);
  "fp8 block"    a scale per 256 rows of Q and K, V K-major;
and, in ms, the pre-passes alone, each timed as a CUDA graph of 10 (GPU time, no host launch time
in it): "v_prep" V's K-major pre-pass, "quant" the quantisation of q, k, v from bf16 as a model
would (Q and K per 256 rows with incoherent processing, V per tensor and K-major); "fp8 e2e" =
quant + fp8 block, the figure to compare with bf16 when the inputs start in bf16. (Before
2026-11-27, evening: "fp8 block" and "fp8 e2e" included V's pre-pass, and "fp8 kernel" was fp8 less
an event-timed v_prep, which counted host time.) Every column is timed in `--rounds` interleaved
rounds (`timing.interleaved`: each round's order a Williams design's, since what runs just before a
kernel moves its time, docs/performance/fp8.md, "FP8 tiles between panels"); the figures are
medians over rounds, the ratios to bf16 medians of the rounds' ratios.
"""
import argparse
import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

MODE = common.select_backend()
BLOCK = 256   # variants.fp8.DEFAULT_BLOCK (not imported before the backend is chosen)

# FA3 paper, Table 3 (RMSE, outlier inputs): FA3 FP16 1.9e-4; FP8 baseline (per tensor) 2.4e-2;
# FA3 FP8 without block quantisation (= incoherent only) 9.3e-3; without incoherent processing
# (= block only) 2.4e-2; FA3 FP8 (both) 9.1e-3.
PAPER_RMSE = {"fp16": 1.9e-4, "fp8 tensor": 2.4e-2, "fp8 block": 2.4e-2,
              "fp8 incoherent": 9.3e-3, "fp8 block+incoherent": 9.1e-3}


def draw(rng, shape, outliers):
    """N(0, 1), plus (outliers) N(0, 100) at a random 0.1% of the entries, as fp16."""
    import numpy as np
    x = rng.standard_normal(shape)
    if outliers:
        x += 10.0 * rng.standard_normal(shape) * (rng.random(shape) < 1e-3)
    return x.astype(np.float16)


def fp8_forward(q, k, v, *, causal, block, incoherent, seed=0):
    """Quantise 16-bit q, k, v (block: rows a scale for Q and K; V one a head) and run fa3 FP8."""
    import variants
    from variants import fp8
    signs = fp8.random_signs(q.shape[3], seed) if incoherent else None
    q8, qd = fp8.quantize_fp8(q, block=block, signs=signs)
    k8, kd = fp8.quantize_fp8(k, block=block, signs=signs)
    v8, vd = fp8.quantize_fp8(v, block=v.shape[1] if block else None)
    return variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd, k_descale=kd,
                            v_descale=vd, scale_block=block or BLOCK, out_dtype="float16")


def accuracy(args):
    import numpy as np

    import variants
    from experiments.measure import inputs, reference
    library = inputs.default_library()
    n = args.seqlen if MODE == "gpu" else 128
    b, h, d = (args.batch, args.heads, 128) if MODE == "gpu" else (1, 1, 128)
    rows_out = []
    print(f"fa3 FP8 accuracy: RMSE of O vs float64, B={b} N={n} H={h} d={d}, non-causal ({MODE})")
    print(f"{'inputs':22} {'method':22} {'RMSE':>10} {'paper':>9}")
    for outliers in (True, False):
        rng = np.random.default_rng(args.seed)
        host = [draw(rng, (b, n, h, d), outliers) for _ in range(3)]
        dev = [inputs.to_device(x, library) for x in host]
        rows = np.unique(rng.choice(n, min(n, 512)))
        o_ref, _ = reference.attention(*host, rows=rows)
        methods = [("fp16", lambda: variants.forward(*dev, variant="fa3")),
                   ("fp8 tensor", lambda: fp8_forward(*dev, causal=False, block=None, incoherent=False)),
                   ("fp8 block", lambda: fp8_forward(*dev, causal=False, block=BLOCK, incoherent=False)),
                   ("fp8 incoherent", lambda: fp8_forward(*dev, causal=False, block=None, incoherent=True)),
                   ("fp8 block+incoherent", lambda: fp8_forward(*dev, causal=False, block=BLOCK, incoherent=True))]
        label = "N(0,1)+0.1% N(0,100)" if outliers else "N(0,1)"
        for name, run in methods:
            o = inputs.to_host(run()[0]).astype(np.float64)[:, rows]
            rmse = float(np.sqrt(np.mean((o - o_ref) ** 2)))
            paper = PAPER_RMSE[name] if outliers else float("nan")
            print(f"{label:22} {name:22} {rmse:10.3e} {paper:9.1e}", flush=True)
            rows_out.append(dict(inputs=label, method=name, rmse=rmse, paper_rmse=paper, batch=b,
                                 seqlen=n, heads=h, head_dim=d, seed=args.seed, mode=MODE))
    _write(args.csv, rows_out)


def speed(args):
    import statistics

    import numpy as np

    import variants
    from common.hardware import target
    from experiments import peers
    from experiments.measure import checks, flops, inputs, reference, timing
    from variants import fp8
    if MODE != "gpu":
        raise SystemExit("speed needs a GPU")
    d = args.head_dim
    heads = 2048 // d   # the FA2 paper's hidden size, 2048
    rows_out = []
    print(f"{'causal':>6} {'seqlen':>6} " + " ".join(f"{c:>11}" for c in SPEED_COLUMNS) +
          "   (TFLOP/s; quant, v_prep in ms)")
    for causal in (c == "1" for c in args.causal.split(",")):
        for n in map(int, args.seqlens.split(",")):
            b = max(1, 16384 // n)
            rng = np.random.default_rng(0)
            n_sets = max(1, math.ceil(128e6 / (3 * b * n * heads * d * 2)))
            hosts = [inputs.random_qkv(rng, b, n, heads, d, "bfloat16") for _ in range(n_sets)]
            sets = [tuple(inputs.to_device(x, "torch") for x in host) for host in hosts]
            signs = inputs.to_device(fp8.random_signs(d, 0), "torch")   # (no copy in a graph)
            quantised = {}   # per (Q and K's block, V K-major): each set's q8, k8, v8 and descales
            for block, k_major in ((None, False), (None, True), (BLOCK, True)):
                qs = []
                for q, k, v in sets:
                    q8, qd = fp8.quantize_fp8(q, block=block)
                    k8, kd = fp8.quantize_fp8(k, block=block)
                    v8, vd = fp8.quantize_fp8(v, block=None, k_major=k_major)
                    qs.append((q8, k8, v8, qd, kd, vd))
                quantised[block, k_major] = qs
            total = flops.attention_flops(b, heads, n, n, d, causal)
            check_rows = np.unique(rng.choice(n, 32))
            ref = reference.attention(*hosts[0], causal=causal, rows=check_rows)

            def fp8_fn(block, k_major, **options):
                def fn(i):
                    q8, k8, v8, qd, kd, vd = quantised[block, k_major][i % n_sets]
                    return variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd,
                                            k_descale=kd, v_descale=vd, **options)
                return fn

            fns = {}
            for p in ("sdpa_flash", "sdpa_cudnn"):
                f = peers.forward_fn(p, causal, None, gqa=False)
                fns[p] = lambda i, f=f: f(*sets[i % n_sets])
            fns["fa3 bf16"] = lambda i: variants.forward(*sets[i % n_sets], variant="fa3", causal=causal)
            fns["fp8"] = fp8_fn(None, False)
            fns["fp8 V^T"] = fp8_fn(None, True)
            if d in IN_KERNEL_HEAD_DIMS:
                fns["fp8 in-kern"] = fp8_fn(None, False, transpose_v="producer")   # V^T by the producer
            fns["fp8 block"] = fp8_fn(BLOCK, True)
            status = {}
            for name, fn in fns.items():
                out = fn(0)
                o = out[0] if isinstance(out, tuple) else out
                got = checks.compare(inputs.to_host(o)[:, check_rows], ref[1], *ref, "bfloat16")
                # FP8's error budget is 16x bf16's: its check is against the e4m3 unit roundoff
                status[name] = "ok" if (got["ok"] or (name.startswith("fp8") and
                                                      got["rel_err"] <= 2 * fp8.UNIT_ROUNDOFF)) else "FAIL"
            q, k, v = sets[0]
            v8 = quantised[None, False][0][2]
            graphs = {"v_prep": _graphed(lambda: fp8.v_k_major(v8)),
                      "quant": _graphed(lambda: (fp8.quantize_fp8(q, block=BLOCK, signs=signs),
                                                 fp8.quantize_fp8(k, block=BLOCK, signs=signs),
                                                 fp8.quantize_fp8(v, block=None, k_major=True)))}
            for name, (g, _) in graphs.items():
                fns[name] = lambda i, g=g: g.replay()
            # every column in interleaved rounds (timing.interleaved): ms and the two ratios to
            # bf16 are medians over the rounds, each ratio taken within its round
            rounds = dict(zip(fns, timing.interleaved(list(fns.values()), rounds=args.rounds)))
            per = {k: [t.median_ms / (GRAPH_REPS if k in graphs else 1) for t in r]
                   for k, r in rounds.items()}
            per["fp8 e2e"] = [a + b for a, b in zip(per["quant"], per["fp8 block"])]
            ms = {k: statistics.median(v) for k, v in per.items()}
            tf = {k: total / v / 1e9 for k, v in ms.items()}

            def over_bf16(name):
                return statistics.median(b / a for a, b in zip(per[name], per["fa3 bf16"]))
            cells = [f"{'-':>11}" if c not in ms else f"{ms[c]:11.3f}" if c in ("quant", "v_prep")
                     else f"{tf[c]:11.1f}" for c in SPEED_COLUMNS]
            bad = [k for k, v in status.items() if v != "ok"]
            in_kern = f" in-kern/bf16 {over_bf16('fp8 in-kern'):.2f}" if "fp8 in-kern" in ms else ""
            print(f"{int(causal):>6} {n:>6} " + " ".join(cells) +
                  f"   fp8/bf16 {over_bf16('fp8'):.2f} V^T/bf16 {over_bf16('fp8 V^T'):.2f}"
                  f" block/bf16 {over_bf16('fp8 block'):.2f}" + in_kern +
                  (f"  FAIL: {bad}" if bad else ""), flush=True)
            for k, v in ms.items():
                rows_out.append(dict(kernel=k, causal=causal, seqlen=n, batch=b, heads=heads,
                                     head_dim=d, ms=v, tflops=tf[k], check=status.get(k, ""),
                                     gpu=target.describe()))
    _write(args.csv, rows_out)


def configs(args):
    """fa3 FP8 (one scale a head) forward TFLOP/s for several option sets, beside fa3 bf16, in
    interleaved rounds (`timing.interleaved`): each round times bf16 and every option set, in an
    order that changes from round to round, so a ratio compares calls made under the same clocks;
    printed: the median over rounds, and the ratio to bf16 as the median of the rounds' ratios
    with their range."""
    import json
    import statistics

    import numpy as np

    import variants
    from experiments.measure import flops, inputs, timing
    from variants import fp8
    d = args.head_dim
    heads = 2048 // d   # the FA2 paper's hidden size, 2048
    options = json.loads(args.configs)
    print(f"# {args.rounds} interleaved rounds; TFLOP/s: median of the rounds' medians; x fa3 bf16: "
          "median [min-max] of the rounds' ratios")
    print("causal seqlen TFLOP/s (x fa3 bf16 [range]) options")
    for causal in (c == "1" for c in args.causal.split(",")):
        for n in map(int, args.seqlens.split(",")):
            b = max(1, 16384 // n)
            rng = np.random.default_rng(0)
            n_sets = max(1, math.ceil(128e6 / (3 * b * n * heads * d * 2)))
            sets = [tuple(inputs.to_device(x, "torch") for x in inputs.random_qkv(rng, b, n, heads, d, "bfloat16"))
                    for _ in range(n_sets)]
            q8s = [tuple(fp8.quantize_fp8(x, block=None) for x in s) for s in sets]
            total = flops.attention_flops(b, heads, n, n, d, causal)
            fns, names = [lambda i: variants.forward(*sets[i % n_sets], variant="fa3", causal=causal)], \
                ["fa3 bf16"]
            for opt in options:
                def fn(i, opt=opt):
                    (q8, qd), (k8, kd), (v8, vd) = q8s[i % n_sets]
                    return variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd,
                                            k_descale=kd, v_descale=vd, **opt)
                try:
                    fn(0)
                except Exception as e:   # a configuration that does not fit is reported, not fatal
                    print(f"{int(causal)} {n} - fp8 {json.dumps(opt)}: {type(e).__name__}: {e}"[:300])
                    continue
                fns.append(fn)
                names.append(f"fp8 {json.dumps(opt)}")
            rounds = timing.interleaved(fns, rounds=args.rounds)
            rates = [[total / t.median_ms / 1e9 for t in r] for r in rounds]
            for name, rate in zip(names, rates):
                ratio = [x / y for x, y in zip(rate, rates[0])]
                print(f"{int(causal)} {n} {statistics.median(rate):.1f} ({statistics.median(ratio):.2f} "
                      f"[{min(ratio):.2f}-{max(ratio):.2f}]) {name}", flush=True)
            for name, rate in zip(names, rates):   # every round, for the record
                print(f"#   {int(causal)} {n} rounds {' '.join(f'{x:.0f}' for x in rate)}  {name}")


def figure(args):
    """Three panels: forward TFLOP/s against seqlen (not causal, causal) of fa3 bf16, FP8 (with
    and without its pre-pass), FP8 block scales, FP8 end to end and sdpa_cudnn; and the RMSE of
    each FP8 method against the paper's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    speed = list(csv.DictReader(open(args.speed)))
    accuracy = list(csv.DictReader(open(args.accuracy)))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    kernels = [k for k in ("fa3 bf16", "fp8", "fp8 V^T", "fp8 kernel", "fp8 block", "fp8 e2e",
                           "sdpa_cudnn") if any(r["kernel"] == k for r in speed)]   # older CSVs: fp8 kernel
    for ax, causal in zip(axes[:2], ("False", "True")):
        for name in kernels:
            pts = sorted((int(r["seqlen"]), float(r["tflops"])) for r in speed
                         if r["kernel"] == name and r["causal"] == causal)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name,
                    linestyle="--" if name == "sdpa_cudnn" else "-",
                    color="black" if name == "sdpa_cudnn" else None)
        ax.set_xscale("log", base=2)
        seqlens = sorted({int(r["seqlen"]) for r in speed})
        ax.set_xticks(seqlens, [f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
        ax.set_title(f"d=128, {'causal' if causal == 'True' else 'not causal'} (batch x seqlen = 16k)")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("forward TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    rows = [r for r in accuracy if r["inputs"].startswith("N(0,1)+")]
    xs = range(len(rows))
    axes[2].bar([x - 0.2 for x in xs], [float(r["rmse"]) for r in rows], 0.4, label="measured")
    axes[2].bar([x + 0.2 for x in xs], [float(r["paper_rmse"]) for r in rows], 0.4, label="FA3 paper")
    axes[2].set_xticks(list(xs), [r["method"].replace("fp8 ", "fp8\n") for r in rows], fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("RMSE of O vs float64")
    axes[2].set_title("inputs N(0,1) + 0.1% N(0,100)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


SPEED_COLUMNS = ("sdpa_flash", "sdpa_cudnn", "fa3 bf16", "fp8", "fp8 V^T", "fp8 in-kern", "fp8 block",
                 "fp8 e2e", "quant", "v_prep")
GRAPH_REPS = 10   # calls of a pre-pass in its timed CUDA graph
IN_KERNEL_HEAD_DIMS = (128,)   # transpose_v="producer" (fa3 refuses it at 256: its registers)


def _graphed(fn):
    """(graph, outputs) of GRAPH_REPS calls of fn captured in one CUDA graph: a replay's time over
    GRAPH_REPS is a call's GPU time, without the host's launch time (which exceeds a short
    pre-pass's own)."""
    from experiments.measure import timing
    return timing.capture_cuda_graph(lambda: [fn() for _ in range(GRAPH_REPS)])


def _write(path, rows):
    if not path or not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--seqlen", type=int, default=4096)
    a.add_argument("--batch", type=int, default=2)
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--csv")
    s = sub.add_parser("speed")
    s.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    s.add_argument("--causal", default="0,1")
    s.add_argument("--head-dim", type=int, default=128, choices=(128, 256))
    s.add_argument("--rounds", type=int, default=3, help="interleaved rounds (timing.interleaved)")
    s.add_argument("--csv")
    c = sub.add_parser("configs")
    c.add_argument("configs", help="JSON list of fa3 option dicts ({} = the defaults)")
    c.add_argument("--seqlens", default="4096,16384")
    c.add_argument("--causal", default="0,1")
    c.add_argument("--head-dim", type=int, default=128, choices=(128, 256))
    c.add_argument("--rounds", type=int, default=5, help="interleaved rounds (timing.interleaved)")
    f = sub.add_parser("figure")
    f.add_argument("speed")
    f.add_argument("accuracy")
    f.add_argument("out")
    args = ap.parse_args(argv)
    {"accuracy": accuracy, "speed": speed, "configs": configs, "figure": figure}[args.what](args)


if __name__ == "__main__":
    main()
