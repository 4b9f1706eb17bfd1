"""HBM traffic measured by Nsight Compute, beside the IO model (FA1 paper Fig. 2 middle, Fig. 3).

    python experiments/ncu.py traffic [--variants standard,fa1,fa2] [--seqlens 4096]
                              [--head-dim 64] [--blocks 32,64,128,256] [--batch B] [--heads H]
                              [--causal 0] [--csv traffic.csv]

The shapes are the FA2 paper's unless --batch / --heads say otherwise: batch x seqlen = 16k
tokens, heads x head_dim = 2048, so that Q, K, V and O (268 MB in bf16) are far larger than the
50-60 MB L2 and the DRAM count is not an artefact of a problem that fits in cache.

Each (variant, seqlen, block) is one forward call in a process of its own under

    ncu --csv --print-units base --clock-control none --profile-from-start off
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum ...

The call runs once first (compilation, first touch), then once between cuProfilerStart and
cuProfilerStop, so that ncu profiles exactly one call's kernels; their DRAM bytes read and
written and their GPU time are summed. Beside them: the bytes the algorithm's loop order implies
with no cache (experiments/io_model.py, times batch x heads) and the compulsory bytes (Q, K, V
read once, O written once). The block is what the IO model's count depends on: fa1's B_c
(`block_n`: its K/V blocks are the outer loop, and O, l, m are re-read and re-written once per
K/V block) and fa2's B_r (`block_m`: K and V are read once per query block); standard has none.
A block a variant's configuration refuses is recorded with the error, and a call that runs out
of memory (standard's S and P at long sequences) as "out of memory". Without ncu on PATH the
command stops with a message saying so.

    python experiments/ncu.py call --variant fa2 --seqlen 4096 --head-dim 64 --options '{"block_m": 64}'

is the profiled process (what `traffic` runs under ncu); `experiments/plot.py traffic.csv
--figure traffic` draws the measured and modelled bytes against the block.
"""
import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
BLOCK_OPTION = {"fa1": "block_n", "fa2": "block_m"}   # the block the IO model's count depends on


def ncu_command(argv, metrics=METRICS, ncu="ncu"):
    """The ncu command line that profiles the cuProfilerStart/Stop range of `argv`."""
    return [ncu, "--csv", "--print-units", "base", "--clock-control", "none",
            "--profile-from-start", "off", "--metrics", ",".join(metrics), *argv]


def _number(text):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return float("nan")


def parse_csv(text):
    """One dict a profiled kernel launch ({"id", "kernel", <metric>: value, ...}) from the output
    of `ncu --csv` (its "==PROF==" lines and the program's own output before the header are
    skipped; values like "6,526,303,488" are read as numbers)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    launches = {}
    for row in csv.DictReader(lines[start:]):
        if not (row.get("ID") or "").isdigit():
            continue
        launch = launches.setdefault(row["ID"], {"id": int(row["ID"]),
                                                 "kernel": row.get("Kernel Name", "")})
        launch[row["Metric Name"]] = _number(row["Metric Value"])
    return list(launches.values())


def model_bytes(variant, n, d, block, batch, heads):
    """(the loop order's bytes with no cache, the compulsory bytes) of a non-causal square
    forward, bf16 (experiments/io_model.py)."""
    from experiments import io_model
    per_head = {"standard": lambda: io_model.standard_bytes(n, d),
                "fa1": lambda: io_model.fa1_bytes(n, d, block),
                "fa2": lambda: io_model.fa2_bytes(n, d, block)}.get(variant)
    compulsory = 4 * n * d * 2 * batch * heads
    return (per_head() * batch * heads if per_head else float("nan")), compulsory


def call(variant, seqlen, head_dim, batch, heads, causal, options):
    """One forward call under the profiler (after an untimed one); what `traffic` runs."""
    import common
    common.select_backend()
    import numpy as np
    from numba import cuda

    import variants
    from common import inputs, target
    library = inputs.default_library()
    q, k, v = (inputs.to_device(x, library) for x in inputs.random_qkv(
        np.random.default_rng(0), batch, seqlen, heads, head_dim, "bfloat16"))

    def run():
        return variants.forward(q, k, v, variant=variant, causal=causal, **options)

    run()
    cuda.synchronize()
    if not target.SIMULATOR:
        cuda.profile_start()
    run()
    cuda.synchronize()
    if not target.SIMULATOR:
        cuda.profile_stop()


def measure(variant, n, d, block, batch, heads, causal, ncu="ncu", run=subprocess.run):
    """The row of one configuration: its call profiled in a process of its own."""
    options = {BLOCK_OPTION[variant]: block} if variant in BLOCK_OPTION and block else {}
    argv = [sys.executable, os.path.abspath(__file__), "call", "--variant", variant,
            "--seqlen", str(n), "--head-dim", str(d), "--batch", str(batch), "--heads",
            str(heads), "--causal", str(int(causal)), "--options", json.dumps(options)]
    out = run(ncu_command(argv, ncu=ncu), capture_output=True, text=True)
    launches = parse_csv(out.stdout)
    model, compulsory = model_bytes(variant, n, d, block, batch, heads)
    row = dict(variant=variant, seqlen=n, head_dim=d, batch=batch, heads=heads, causal=causal,
               block=block or "", options=json.dumps(options), kernels=len(launches),
               dram_read=sum(x.get(METRICS[0], 0) for x in launches),
               dram_write=sum(x.get(METRICS[1], 0) for x in launches),
               gpu_ms=sum(x.get(METRICS[2], 0) for x in launches) / 1e6,
               model_bytes=model, compulsory_bytes=compulsory, status="ok")
    row["dram_bytes"] = row["dram_read"] + row["dram_write"]
    if out.returncode != 0 or not launches:
        tail = (out.stderr or out.stdout or "").strip().splitlines()[-3:]
        text = " ".join(tail)
        row["status"] = "out of memory" if "out of memory" in text.lower() else \
            f"error: {text[-300:]}" if text else f"error: exit {out.returncode}, no kernels"
    return row


def gpu_name():
    """The first GPU's name as nvidia-smi gives it ("" without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def traffic(variant_names, seqlens, head_dim, blocks, batch, heads, causal, ncu="ncu",
            run=subprocess.run):
    """The rows of every (variant, seqlen, block); standard once a seqlen (it has no block)."""
    if run is subprocess.run and shutil.which(ncu) is None:
        raise SystemExit(f"{ncu} (Nsight Compute) is not on PATH: this experiment reads DRAM bytes "
                         "from it; install Nsight Compute or run on the GPU host, which has it")
    gpu = gpu_name()
    rows = []
    for n in seqlens:
        for variant in variant_names:
            for block in (blocks if variant in BLOCK_OPTION else [None]):
                row = measure(variant, n, head_dim, block, batch, heads, causal, ncu, run)
                row["gpu"] = gpu
                rows.append(row)
                ratio = row["dram_bytes"] / row["model_bytes"] if row["model_bytes"] else math.nan
                print(f"{variant:8s} N={n:<6} block={str(block or '-'):>4} "
                      f"DRAM {row['dram_bytes'] / 1e9:8.3f} GB (model {row['model_bytes'] / 1e9:8.3f}, "
                      f"{ratio:5.2f}x; compulsory {row['compulsory_bytes'] / 1e9:.3f}) "
                      f"{row['gpu_ms']:8.3f} ms  {row['status']}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("traffic", help="measured DRAM bytes against block size, beside the model")
    t.add_argument("--variants", default="standard,fa1,fa2")
    t.add_argument("--seqlens", default="4096")
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--blocks", default="32,64,128,256")
    t.add_argument("--batch", type=int, default=0, help="default: 16384 // seqlen")
    t.add_argument("--heads", type=int, default=0, help="default: 2048 // head_dim")
    t.add_argument("--causal", type=int, default=0)
    t.add_argument("--ncu", default="ncu")
    t.add_argument("--csv", default=None)
    c = sub.add_parser("call", help="one forward call in a cuProfilerStart/Stop range")
    c.add_argument("--variant", default="fa2")
    c.add_argument("--seqlen", type=int, default=4096)
    c.add_argument("--head-dim", type=int, default=64)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--heads", type=int, default=16)
    c.add_argument("--causal", type=int, default=0)
    c.add_argument("--options", default="{}")
    args = ap.parse_args(argv)
    if args.command == "call":
        return call(args.variant, args.seqlen, args.head_dim, args.batch, args.heads,
                    bool(args.causal), json.loads(args.options))
    rows = []
    for n in (int(x) for x in args.seqlens.split(",")):
        rows += traffic(args.variants.split(","), [n], args.head_dim,
                        [int(x) for x in args.blocks.split(",")],
                        args.batch or max(1, 16384 // n), args.heads or 2048 // args.head_dim,
                        bool(args.causal), args.ncu)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    main()
