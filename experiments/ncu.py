"""HBM traffic measured by Nsight Compute, beside the IO model (FA1 paper Fig. 2 middle, Fig. 3).

    python experiments/ncu.py traffic [--variants standard,fa1,fa2] [--seqlens 4096]
                              [--head-dim 64] [--blocks 32,64,128,256] [--batch B] [--heads H]
                              [--causal 0] [--pass fwd|fwd_bwd] [--csv traffic.csv]

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
`--pass fwd_bwd` profiles a forward and the backward after it instead (FA1 Fig. 3 counts both):
the compulsory bytes are then the forward's plus the backward's (Q, K, V, O, dO read, dQ, dK, dV
written: 12 N d elements a head), and the model column is empty (the IO model is the forward's).
The CSV is written row by row, so a sweep cut short keeps what it measured.
A block a variant's configuration refuses is recorded with the error, and a call that runs out
of memory (standard's S and P at long sequences) as "out of memory". Without ncu on PATH the
command stops with a message saying so.

    python experiments/ncu.py call --variant fa2 --seqlen 4096 --head-dim 64 --options '{"block_m": 64}'

is the profiled process (what `traffic` runs under ncu); `experiments/plot.py traffic.csv
--figure traffic` draws the measured and modelled bytes against the block.

    python experiments/ncu.py profile --names fa3,sdpa_cudnn --seqlen 4096 --head-dim 128 \
                              [--options '{"pingpong": false}'] [--pass fwd_bwd] [--out DIR]

is where a kernel's time goes, beside a peer's on the same problem (the FA2 paper's shapes by
default): each name's call profiled alone with Nsight Compute's sections (speed of light, pipe
utilisation, warp states, scheduler, instruction mix, occupancy; `PROFILE_SECTIONS`) and source
counters, the report saved in DIR (`ncu -i DIR/<name>.ncu-rep` opens it; DIR/<name>_source.csv is
the per-SASS-line view), and a table of the headline metrics printed side by side. A name is a
variant or an SDPA peer (sdpa_flash, sdpa_cudnn: torch's backend on the same inputs); of a call's
kernels the longest is the one shown.

    python experiments/ncu.py opcodes SOURCE.csv[.gz] [--top 30] [--per 1048576]

reads `ncu -i REP --csv --page source --print-source sass` output (one section a profiled kernel)
and prints each kernel's executed SASS by opcode: the share of its warp instructions, the count
(divided by --per, e.g. the warp-steps of a loop, to give instructions a step) and the share of
its warp-stall samples. Two kernels' columns side by side say where the extra instructions are
(docs/results/bwd_dq_address_h100.txt, decode_page_once_h100.txt were read this way).
"""
import argparse
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import append_row  # noqa: E402

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


PASSES = ("fwd", "fwd_bwd")
# elements of N x d a head that a pass must read or write at least once: the forward Q, K, V, O;
# the backward also Q, K, V, O, dO and dQ, dK, dV
COMPULSORY_ROWS = {"fwd": 4, "fwd_bwd": 4 + 8}


def model_bytes(variant, n, d, block, batch, heads, pass_="fwd"):
    """(the loop order's bytes with no cache, the compulsory bytes) of a non-causal square
    forward, bf16 (experiments/io_model.py); the model is NaN for fwd_bwd (no backward model)."""
    from experiments import io_model
    per_head = {"standard": lambda: io_model.standard_bytes(n, d),
                "fa1": lambda: io_model.fa1_bytes(n, d, block),
                "fa2": lambda: io_model.fa2_bytes(n, d, block)}.get(variant)
    compulsory = COMPULSORY_ROWS[pass_] * n * d * 2 * batch * heads
    model = per_head() * batch * heads if per_head and pass_ == "fwd" else float("nan")
    return model, compulsory


def call(variant, seqlen, head_dim, batch, heads, causal, options, pass_="fwd"):
    """One forward call (pass_="fwd_bwd": a forward and its backward) under the profiler, after an
    untimed one; what `traffic` and `profile` run. `variant` may be an SDPA peer
    (experiments/peers.py) on torch tensors (its backward by torch autograd)."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    import common
    common.select_backend()
    import numpy as np
    from numba import cuda

    import variants
    from common.hardware import target
    from experiments.measure import inputs
    peer = variant.startswith("sdpa_")
    library = "torch" if peer else inputs.default_library()
    q, k, v = (inputs.to_device(x, library) for x in inputs.random_qkv(
        np.random.default_rng(0), batch, seqlen, heads, head_dim, "bfloat16"))
    if peer:
        from experiments import peers
        sdpa = peers.forward_fn(variant, causal, None, False)
        if pass_ == "fwd":
            def run():
                return sdpa(q, k, v)
        else:
            import torch
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            do = torch.randn_like(q)

            def run():
                return torch.autograd.grad(sdpa(*leaves), leaves, do)
    elif pass_ == "fwd":
        def run():
            return variants.forward(q, k, v, variant=variant, causal=causal, **options)
    else:
        do = inputs.to_device(inputs.random_qkv(np.random.default_rng(1), batch, seqlen, heads,
                                                head_dim, "bfloat16")[0], library)

        def run():
            o, lse = variants.forward(q, k, v, variant=variant, causal=causal, **options)
            return variants.backward(do, q, k, v, o, lse, variant=variant, causal=causal)

    run()
    cuda.synchronize()
    if not target.SIMULATOR:
        cuda.profile_start()
    run()
    cuda.synchronize()
    if not target.SIMULATOR:
        cuda.profile_stop()


def measure(variant, n, d, block, batch, heads, causal, ncu="ncu", run=subprocess.run,
            pass_="fwd"):
    """The row of one configuration: its call profiled in a process of its own."""
    options = {BLOCK_OPTION[variant]: block} if variant in BLOCK_OPTION and block else {}
    argv = [sys.executable, os.path.abspath(__file__), "call", "--variant", variant,
            "--seqlen", str(n), "--head-dim", str(d), "--batch", str(batch), "--heads",
            str(heads), "--causal", str(int(causal)), "--options", json.dumps(options),
            "--pass", pass_]
    out = run(ncu_command(argv, ncu=ncu), capture_output=True, text=True)
    launches = parse_csv(out.stdout)
    model, compulsory = model_bytes(variant, n, d, block, batch, heads, pass_)
    row = dict(variant=variant, **{"pass": pass_}, seqlen=n, head_dim=d, batch=batch,
               heads=heads, causal=causal,
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


PROFILE_SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
                    "InstructionStats", "LaunchStats", "Occupancy", "MemoryWorkloadAnalysis",
                    "SourceCounters")
# the rows of `profile`'s table: metric names matching one of these (rows all zero left out)
HEADLINE = (r"^gpu__time_duration\.sum$", r"^launch__(registers_per_thread|block_size|grid_size|"
            r"shared_mem_per_block_(dynamic|static)|occupancy_limit_registers)$",
            r"^sm__throughput\.avg\.pct", r"^sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active$",
            r"^sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$",
            r"^sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active$",
            r"^smsp__inst_executed\.sum$", r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
            r"^smsp__warps_active\.avg\.per_cycle_active$",
            r"^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$",
            r"^smsp__sass_inst_executed_op_.*\.sum$", r"^dram__bytes_(read|write)\.sum$",
            r"^l1tex__data_bank_conflicts_pipe_lsu_mem_shared.*\.sum$")


def parse_raw(text):
    """One dict a kernel launch ({metric: value or text}) from `ncu -i REP --csv --page raw`
    (a header of metric names, a row of units, a row a launch)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    header, launches = rows[0], []
    for row in rows[2:]:
        if row and row[0].isdigit():
            launches.append({name: (_number(value) if not math.isnan(_number(value)) else value)
                             for name, value in zip(header, row)})
    return launches


def headline(launch):
    """The metrics of one launch that `profile` prints, in HEADLINE's order."""
    picked = {}
    for pattern in HEADLINE:
        for name in sorted(launch):
            if name not in picked and re.search(pattern, name) and isinstance(launch[name], float):
                picked[name] = launch[name]
    return picked


def profile(names, seqlen, head_dim, batch, heads, causal, options, out_dir, ncu="ncu",
            run=subprocess.run, pass_="fwd"):
    """{name: the headline metrics of its call's longest kernel}, each call under ncu's
    PROFILE_SECTIONS in a process of its own; reports and per-line source views in out_dir.
    pass_="fwd_bwd": a forward and its backward, whose longest kernel is the backward's."""
    if run is subprocess.run and shutil.which(ncu) is None:
        raise SystemExit(f"{ncu} (Nsight Compute) is not on PATH: install it or run on the GPU host")
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for name in names:
        argv = [sys.executable, os.path.abspath(__file__), "call", "--variant", name, "--seqlen",
                str(seqlen), "--head-dim", str(head_dim), "--batch", str(batch), "--heads",
                str(heads), "--causal", str(int(causal)),
                "--options", json.dumps({} if name.startswith("sdpa_") else options),
                "--pass", pass_]
        report = os.path.join(out_dir, name)
        sections = [x for s in PROFILE_SECTIONS for x in ("--section", s)]
        out = run([ncu, "--clock-control", "none", "--profile-from-start", "off",
                   "--import-source", "yes", *sections, "-f", "-o", report, *argv],
                  capture_output=True, text=True)
        if out.returncode != 0:
            tail = " ".join((out.stderr or out.stdout or "").strip().splitlines()[-3:])
            print(f"{name}: ncu failed (exit {out.returncode}): {tail[-400:]}", flush=True)
            continue
        raw = run([ncu, "-i", report + ".ncu-rep", "--csv", "--page", "raw", "--print-units",
                   "base"], capture_output=True, text=True)
        launches = parse_raw(raw.stdout)
        with open(os.path.join(out_dir, f"{name}_raw.csv"), "w") as f:
            f.write(raw.stdout)
        source = run([ncu, "-i", report + ".ncu-rep", "--csv", "--page", "source",
                      "--print-source", "sass"], capture_output=True, text=True)
        with open(os.path.join(out_dir, f"{name}_source.csv"), "w") as f:
            f.write(source.stdout or source.stderr)
        if not launches:
            print(f"{name}: no kernel in the report", flush=True)
            continue
        longest = max(launches, key=lambda x: x.get("gpu__time_duration.sum", 0)
                      if isinstance(x.get("gpu__time_duration.sum"), float) else 0)
        results[name] = headline(longest)
        results[name]["kernel"] = str(longest.get("Kernel Name", ""))[:60]
    return results


def print_profile(results):
    names = list(results)
    metrics = []
    for r in results.values():
        metrics += [m for m in r if m != "kernel" and m not in metrics]
    print(f"{'metric':72s}" + "".join(f"{n:>18s}" for n in names))
    for n in names:
        print(f"  {n}: {results[n]['kernel']}")
    for m in metrics:
        values = [results[n].get(m) for n in names]
        if all(not v for v in values):
            continue
        print(f"{m[:72]:72s}" + "".join(f"{v:18,.2f}" if isinstance(v, float) else f"{'-':>18s}"
                                        for v in values))


def gpu_name():
    """The first GPU's name as nvidia-smi gives it ("" without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def traffic(variant_names, seqlens, head_dim, blocks, batch, heads, causal, ncu="ncu",
            run=subprocess.run, pass_="fwd", csv_path=None):
    """The rows of every (variant, seqlen, block); standard once a seqlen (it has no block);
    each appended to csv_path (when given) as soon as it is measured."""
    if run is subprocess.run and shutil.which(ncu) is None:
        raise SystemExit(f"{ncu} (Nsight Compute) is not on PATH: this experiment reads DRAM bytes "
                         "from it; install Nsight Compute or run on the GPU host, which has it")
    gpu = gpu_name()
    rows = []
    for n in seqlens:
        for variant in variant_names:
            for block in (blocks if variant in BLOCK_OPTION else [None]):
                row = measure(variant, n, head_dim, block, batch, heads, causal, ncu, run, pass_)
                row["gpu"] = gpu
                rows.append(row)
                if csv_path:
                    append_row(csv_path, row)
                ratio = row["dram_bytes"] / row["model_bytes"] if row["model_bytes"] else math.nan
                print(f"{variant:8s} {pass_:7s} N={n:<6} block={str(block or '-'):>4} "
                      f"DRAM {row['dram_bytes'] / 1e9:8.3f} GB (model {row['model_bytes'] / 1e9:8.3f}, "
                      f"{ratio:5.2f}x; compulsory {row['compulsory_bytes'] / 1e9:.3f}) "
                      f"{row['gpu_ms']:8.3f} ms  {row['status']}", flush=True)
    return rows


_OPCODE = re.compile(r"^\s*(?:@!?U?P[A-Z0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def opcode_mix(lines):
    """[(kernel name, {opcode: [executed, stall samples]})] from the lines of ncu's source page
    (CSV: a "Kernel Name" row, then a header row starting "Address", then a row a SASS line)."""
    kernels, header = [], None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append((row[1] if len(row) > 1 else "?", {}))
            header = None
        elif row[0] == "Address":
            header = {name: i for i, name in enumerate(row)}
        elif header is not None and kernels:
            m = _OPCODE.match(row[header["Source"]])
            if not m:
                continue
            def number(column):
                text = row[header[column]].replace(",", "") if column in header else ""
                return int(float(text)) if text not in ("", "-") else 0
            counts = kernels[-1][1].setdefault(m.group(1), [0, 0])
            counts[0] += number("Instructions Executed")
            counts[1] += number("Warp Stall Sampling (All Samples)")
    return kernels


def print_opcode_mix(kernels, top=30, per=1):
    for name, ops in kernels:
        executed = sum(c[0] for c in ops.values()) or 1
        samples = sum(c[1] for c in ops.values()) or 1
        print(f"== {name[:100]}: {executed:,} warp instructions, {samples:,} stall samples")
        print(f"  {'opcode':12s} {'executed':>8s} {'count' if per == 1 else 'per ' + str(per):>16s} "
              f"{'stalls':>7s}")
        for op, (n, st) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {op:12s} {100 * n / executed:7.2f}% {n / per:16,.1f} {100 * st / samples:6.1f}%")


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
    t.add_argument("--pass", dest="pass_", default="fwd", choices=PASSES)
    t.add_argument("--ncu", default="ncu")
    t.add_argument("--csv", default=None, help="appended to, a row as it is measured")
    c = sub.add_parser("call", help="one forward call in a cuProfilerStart/Stop range")
    c.add_argument("--variant", default="fa2")
    c.add_argument("--seqlen", type=int, default=4096)
    c.add_argument("--head-dim", type=int, default=64)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--heads", type=int, default=16)
    c.add_argument("--causal", type=int, default=0)
    c.add_argument("--options", default="{}")
    c.add_argument("--pass", dest="pass_", default="fwd", choices=PASSES)
    pr = sub.add_parser("profile", help="where a kernel's time goes, beside a peer's (ncu sections)")
    pr.add_argument("--names", default="fa3,sdpa_cudnn")
    pr.add_argument("--seqlen", type=int, default=4096)
    pr.add_argument("--head-dim", type=int, default=128)
    pr.add_argument("--batch", type=int, default=0, help="default: 16384 // seqlen")
    pr.add_argument("--heads", type=int, default=0, help="default: 2048 // head_dim")
    pr.add_argument("--causal", type=int, default=0)
    pr.add_argument("--options", default="{}", help="the variants' options (JSON)")
    pr.add_argument("--out", default="ncu_profile")
    pr.add_argument("--ncu", default="ncu")
    pr.add_argument("--pass", dest="pass_", default="fwd", choices=PASSES,
                    help="fwd_bwd: the backward's kernel (the call's longest)")
    op = sub.add_parser("opcodes", help="executed SASS by opcode, from ncu's source page CSV")
    op.add_argument("source", help="ncu -i REP --csv --page source --print-source sass (or .gz)")
    op.add_argument("--top", type=int, default=30)
    op.add_argument("--per", type=int, default=1, help="divide counts by this (e.g. warp-steps)")
    args = ap.parse_args(argv)
    if args.command == "opcodes":
        import gzip
        opener = gzip.open if args.source.endswith(".gz") else open
        with opener(args.source, "rt") as f:
            kernels = opcode_mix(f)
        print_opcode_mix(kernels, args.top, args.per)
        return kernels
    if args.command == "profile":
        results = profile(args.names.split(","), args.seqlen, args.head_dim,
                          args.batch or max(1, 16384 // args.seqlen),
                          args.heads or 2048 // args.head_dim, bool(args.causal),
                          json.loads(args.options), args.out, args.ncu, pass_=args.pass_)
        print_profile(results)
        return results
    if args.command == "call":
        return call(args.variant, args.seqlen, args.head_dim, args.batch, args.heads,
                    bool(args.causal), json.loads(args.options), args.pass_)
    rows = []
    for n in (int(x) for x in args.seqlens.split(",")):
        rows += traffic(args.variants.split(","), [n], args.head_dim,
                        [int(x) for x in args.blocks.split(",")],
                        args.batch or max(1, 16384 // n), args.heads or 2048 // args.head_dim,
                        bool(args.causal), args.ncu, pass_=args.pass_, csv_path=args.csv)
    if args.csv and rows:
        print(f"rows appended to {args.csv}")
    return rows


if __name__ == "__main__":
    main()
