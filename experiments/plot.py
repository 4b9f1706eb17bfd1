"""Figures redrawn from the CSVs the experiments write (no re-running to re-plot).

    python experiments/plot.py <results.csv> --figure speed [--pass fwd|bwd|fwd_bwd] [--out speed.png]
                               [--ceiling 790]
    python experiments/plot.py <results.csv> --figure ablation
    python experiments/plot.py <decode.csv> --figure decode
    python experiments/plot.py <compare_configs table .txt> --figure speed
    python experiments/plot.py <traffic.csv> --figure traffic
    python experiments/plot.py <traffic.csv> --figure traffic_seqlen
    python experiments/plot.py <results.csv> --figure memory

speed     TFLOP/s against sequence length, grouped bars a seqlen, one panel a (head_dim, causal):
          the FA2 paper's Fig. 4-6 from `run.py -m experiment=fa2_grid` (pass=fwd) or a fwd_bwd grid
          (`experiment=bwd_grid`); this codebase's variants in colour, the SDPA peers in grey; a
          dashed line at --ceiling (the tensor cores' dense bf16 rate measured on the GPU, if given)
ablation  TFLOP/s of one variant with each of its levers switched off (`experiment=fa2_ablations`:
          the job's `ablation=<name>`), one panel a (head_dim, causal), the default first
decode    GB/s of K and V read against cache length, one panel a batch (experiments/decode.py's
          CSV), the copy bandwidth of the run as the dashed ceiling
traffic   HBM bytes of a forward call against the block size, measured by ncu and modelled
          (experiments/ncu.py traffic's CSV): the FA1 paper's Fig. 2 (middle)
traffic_seqlen  the same CSV against sequence length: standard beside fa1 and fa2 at one block
          each (TRAFFIC_BLOCKS: their defaults at head_dim 64), measured and modelled,
          standard's ratio to fa2's measured bytes at each point: FA1 paper Fig. 3's HBM side
memory    peak memory beyond the inputs against sequence length (`experiment=bwd_memory`'s
          peak_mem_mib), one line a kernel, standard's ratio to the flash kernel written at each
          point: the FA1 paper's Fig. 3 (right)

The title names the GPU from the CSV; docs/figures/README.md lists each committed figure with its
command, GPU and commit.
"""
import argparse
import csv
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OURS = {"standard": "#1f77b4", "fa1": "#ff7f0e", "fa2": "#2ca02c", "fa3": "#d62728"}
PEERS = {"sdpa_flash": "#7f7f7f", "sdpa_cudnn": "#b0b0b0", "sdpa_math": "#d8d8d8",
         "sdpa_efficient": "#c8c8c8"}


def read(path):
    """The rows of a results CSV, or of a compare_configs.py table (read_table)."""
    if path.endswith(".txt"):
        return read_table(path)
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_table(path):
    """The rows of `experiments/compare_configs.py`'s printed table ("hd causal seqlen TFLOP/s
    (ratio) median_ms check name" after '#' comment lines that hold its command and GPU) as
    results-CSV rows: a peer keeps its name, the variant's default configuration ("{}") is named
    after `--variant`, any other configuration "<variant> <options>"."""
    with open(path) as f:
        lines = f.read().splitlines()
    comments = " ".join(line for line in lines if line.startswith("#"))
    m = re.search(r"--variant (\w+)", comments)
    variant = m.group(1) if m else "fa2"   # compare_configs' default
    gpu = re.search(r"(NVIDIA )?(H100|H200|A100)[\w ]*?(?= \(|,|$)", comments)
    rows = []
    for line in lines:
        parts = line.split(None, 6)
        if line.startswith("#") or len(parts) < 7 or not parts[0].isdigit():
            continue
        hd, causal, seqlen, tflops, _, ms, rest = parts
        check, name = rest.split(None, 1)
        rows.append({"variant": variant if name == "{}" else name if name in PEERS
                     else f"{variant} {name}", "head_dim": hd, "causal": str(causal == "1"),
                     "seqlen": seqlen, "fwd_tflops": tflops, "fwd_ms": ms, "check": check,
                     "gpu": gpu.group(0) if gpu else ""})
    return rows


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _one_pass(rows):
    """The pass all rows are of (a row without the column is a forward's); several: refused."""
    passes = sorted({r.get("pass") or "fwd" for r in rows})
    if len(passes) > 1:
        raise SystemExit(f"the rows hold the passes {', '.join(passes)}: choose one with --pass")
    return passes[0]


# what the traffic figures call one call of a pass, and its compulsory bytes
PASS_WORDS = {"fwd": ("one forward", "Q, K, V read + O written"),
              "fwd_bwd": ("one forward + backward",
                          "fwd: Q, K, V read, O written; bwd: Q, K, V, O, dO read, dQ, dK, dV written")}


def _tflops(row):
    """The timed pass's TFLOP/s (pass=fwd rows keep theirs in fwd_tflops)."""
    value = row.get("tflops") or row.get("fwd_tflops") or ""
    return float(value) if value not in ("", "nan") else float("nan")


def _panels(rows):
    return sorted({(int(r["head_dim"]), r["causal"] == "True") for r in rows})


def _title(rows, what):
    gpus = sorted({r.get("gpu", "") for r in rows if r.get("gpu")})
    return f"{what}: {', '.join(gpus)}"


def _save(plt, fig, rows, what, out):
    """Title (what, and the GPUs the rows name), layout, the PNG written, the figure closed."""
    fig.suptitle(_title(rows, what), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def speed(rows, out, ceiling=None):
    """Grouped bars: per seqlen, one bar a kernel (ours in colour, peers in grey)."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("check", "ok") == "ok" and r.get("status", "ok") == "ok"]
    kernels = [k for k in list(OURS) + list(PEERS) if any(r["variant"] == k for r in rows)]
    panels = _panels(rows)
    passes = [_one_pass(rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        mine = [r for r in rows if int(r["head_dim"]) == d and (r["causal"] == "True") == causal]
        seqlens = sorted({int(r["seqlen"]) for r in mine})
        width = 0.8 / max(1, len(kernels))
        for i, kernel in enumerate(kernels):
            by_n = {int(r["seqlen"]): _tflops(r) for r in mine if r["variant"] == kernel}
            xs = [j + (i - (len(kernels) - 1) / 2) * width for j in range(len(seqlens))]
            ax.bar(xs, [by_n.get(n, float("nan")) for n in seqlens], width, label=kernel,
                   color=OURS.get(kernel) or PEERS.get(kernel), edgecolor="black", linewidth=0.3)
        if ceiling:
            ax.axhline(ceiling, ls="--", color="black", lw=0.8, label=f"{ceiling:g} TFLOP/s")
        ax.set_xticks(range(len(seqlens)))
        ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
        ax.set_xlabel("sequence length")
        ax.set_title(f"head_dim {d}, {'causal' if causal else 'not causal'}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(f"TFLOP/s ({'+'.join(passes)})")
    axes[0][-1].legend(fontsize=7)
    _save(plt, fig, rows, "speed against sequence length", out)


def _ablation(row):
    m = re.search(r"ablation=([\w-]+)", row.get("job", ""))
    return m.group(1) if m else (row.get("label") or "none")


def ablation(rows, out):
    """One bar a lever changed (fa2: switched off; fa3: off, or on for intra_overlap), beside the
    defaults ("none"), per (head_dim, causal)."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("check", "ok") == "ok" and r["variant"] in OURS]
    panels = _panels(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        got = defaultdict(list)
        for r in rows:
            if int(r["head_dim"]) == d and (r["causal"] == "True") == causal:
                got[_ablation(r)].append(_tflops(r))
        names = ["none"] + sorted(n for n in got if n != "none")
        names = [n for n in names if n in got]
        values = [max(got[n]) for n in names]
        colors = [OURS.get(rows[0]["variant"], "#2ca02c") if n == "none" else "#9ecae1"
                  for n in names]
        ax.barh(range(len(names)), values, color=colors, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(["defaults" if n == "none" else f"ablation={n}" for n in names],
                           fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOP/s")
        ax.set_title(f"head_dim {d}, {'causal' if causal else 'not causal'}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    _save(plt, fig, rows, f"{rows[0]['variant']}: one lever changed at a time (conf/ablation/)", out)


def decode(rows, out):
    """GB/s of K and V read against cache length, a panel a batch (experiments/decode.py)."""
    plt = _pyplot()
    batches = sorted({int(r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if int(r["batch"]) == batch]
        for name, style, color in (("decode", "o-", OURS["fa2"]),
                                   ("decode, CUDA graph", "o:", OURS["fa3"]),
                                   ("decode, no split", "s--", "#98df8a"),
                                   ("fa2", "^:", OURS["fa1"]), ("sdpa_flash", "x-", PEERS["sdpa_flash"]),
                                   ("sdpa_cudnn", "+-", PEERS["sdpa_cudnn"])):
            pts = sorted((int(r["seqlen_k"]), float(r["gbs"])) for r in mine
                         if r["kernel"] == name or (name == "decode" and r["kernel"].startswith(
                             "decode (") and r.get("host_us", "") != ""))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=name)
        ref = next((r for r in mine if float(r.get("of_copy") or 0) > 0), None)
        if ref:
            ax.axhline(float(ref["gbs"]) / float(ref["of_copy"]), ls="--", color="black", lw=0.8,
                       label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length (tokens)")
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s of K, V read")
    axes[0][-1].legend(fontsize=7)
    _save(plt, fig, rows, "decoding, one new token", out)


def traffic(rows, out):
    """HBM bytes of one forward call against the block (experiments/ncu.py): measured DRAM bytes
    solid, the IO model's count (no cache) dashed, one colour a variant; standard (no block) and
    the compulsory bytes (Q, K, V read, O written) as horizontal lines; one panel a seqlen."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("status", "ok") == "ok"]
    call, compulsory_label = PASS_WORDS[_one_pass(rows)]
    seqlens = sorted({int(r["seqlen"]) for r in rows})
    fig, axes = plt.subplots(1, len(seqlens), figsize=(4.8 * len(seqlens), 3.8), squeeze=False)
    for ax, n in zip(axes[0], seqlens):
        mine = [r for r in rows if int(r["seqlen"]) == n]
        for variant in [v for v in OURS if any(r["variant"] == v for r in mine)]:
            pts = sorted((int(r["block"]), float(r["dram_bytes"]), float(r["model_bytes"]))
                         for r in mine if r["variant"] == variant and r.get("block"))
            color = OURS[variant]
            if pts:
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] for p in pts], "o-", color=color, label=f"{variant} measured")
                ax.plot(xs, [p[2] for p in pts], "x--", color=color, label=f"{variant} model")
            for r in mine:
                if r["variant"] == variant and not r.get("block"):
                    ax.axhline(float(r["dram_bytes"]), color=color, label=f"{variant} measured")
                    ax.axhline(float(r["model_bytes"]), color=color, ls="--",
                               label=f"{variant} model")
        ax.axhline(float(mine[0]["compulsory_bytes"]), color="black", ls=":", lw=0.8,
                   label=compulsory_label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("block (fa1: B_c, fa2: B_r)")
        ax.set_title(f"seqlen {n}, head_dim {mine[0]['head_dim']}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(f"HBM bytes of {call}")
    axes[0][-1].legend(fontsize=6)
    _save(plt, fig, rows, "HBM traffic against block size", out)


# the block of each blocked variant that traffic_seqlen draws: fa1's B_c and fa2's B_r at their
# defaults for head_dim 64 (variants/fa1.py, variants/fa2.py DEFAULTS); where a CSV lacks it, the
# block with the fewest measured bytes at that seqlen
TRAFFIC_BLOCKS = {"fa1": 256, "fa2": 128}


def traffic_seqlen(rows, out):
    """HBM bytes of one forward call against seqlen (log-log): one colour a variant, measured
    solid, the IO model dashed, the compulsory bytes dotted; blocked variants at TRAFFIC_BLOCKS;
    over standard's measured points, its ratio to fa2's (else the first flash variant's)."""
    plt = _pyplot()
    rows = [r for r in rows
            if r.get("status", "ok") == "ok" and r.get("dram_bytes") not in ("", None)]
    if not rows:
        raise SystemExit("no measured row (status ok): run experiments/ncu.py traffic on a GPU")
    call, compulsory_label = PASS_WORDS[_one_pass(rows)]
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    measured = {}
    for variant in [v for v in OURS if any(r["variant"] == v for r in rows)]:
        pts, blocks = [], set()
        for n in sorted({int(r["seqlen"]) for r in rows if r["variant"] == variant}):
            mine = [r for r in rows if r["variant"] == variant and int(r["seqlen"]) == n]
            pick = [r for r in mine if not r.get("block")
                    or int(r["block"]) == TRAFFIC_BLOCKS.get(variant)]
            row = pick[0] if pick else min(mine, key=lambda r: float(r["dram_bytes"]))
            blocks.add(row.get("block") or "")
            pts.append((n, float(row["dram_bytes"]), float(row["model_bytes"])))
        measured[variant] = {n: b for n, b, _ in pts}
        label = variant + (f" (block {'/'.join(sorted(blocks))})" if blocks != {""} else "")
        color = OURS[variant]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color,
                label=f"{label} measured")
        if any(p[2] == p[2] for p in pts):   # a model (fwd_bwd has none: NaN)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color,
                    label=f"{variant} model")
    flash = next((k for k in ("fa2", "fa3", "fa1") if k in measured), None)
    if "standard" in measured and flash:
        for n, b in measured["standard"].items():
            if measured[flash].get(n):
                ax.annotate(f"{b / measured[flash][n]:.0f}x", (n, b), fontsize=7,
                            textcoords="offset points", xytext=(-6, 6))
    compulsory = sorted({(int(r["seqlen"]), float(r["compulsory_bytes"])) for r in rows})
    ax.plot([c[0] for c in compulsory], [c[1] for c in compulsory], ":", color="black", lw=0.8,
            label=compulsory_label)
    ns = sorted({int(r["seqlen"]) for r in rows})
    shapes = sorted({(r.get("batch", "?"), r.get("heads", "?"), r["head_dim"]) for r in rows
                     if int(r["seqlen"]) == ns[-1]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
    ax.set_xlabel("sequence length (batch x seqlen fixed; "
                  + ", ".join(f"{h} heads, d={d}" for _, h, d in shapes) + ")")
    ax.set_ylabel(f"HBM bytes of {call}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    _save(plt, fig, rows, "HBM traffic against sequence length", out)


def memory(rows, out):
    """Peak memory a call allocates beyond its inputs (MiB, log scale) against seqlen (log 2), one
    line a kernel (ours in colour, peers in grey), one panel a (pass, head_dim, causal); over
    standard's points, its ratio to the lowest flash kernel's (fa2 or fa3, else the first other)
    at that seqlen. Rows without a peak (out of memory, or the simulator's) are left out."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("peak_mem_mib") not in (None, "", "nan")
            and r.get("status", "ok") == "ok"]
    if not rows:
        raise SystemExit("no row has a peak_mem_mib: run a GPU job (e.g. experiment=bwd_memory)")
    panels = sorted({(r.get("pass") or "fwd", int(r["head_dim"]), r["causal"] == "True")
                     for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (pass_, d, causal) in zip(axes[0], panels):
        mine = [r for r in rows if (r.get("pass") or "fwd") == pass_ and int(r["head_dim"]) == d
                and (r["causal"] == "True") == causal]
        lines = {}
        for kernel in [k for k in list(OURS) + list(PEERS) if any(r["variant"] == k for r in mine)]:
            pts = sorted((int(r["seqlen"]), float(r["peak_mem_mib"]))
                         for r in mine if r["variant"] == kernel)
            lines[kernel] = dict(pts)
            peer = kernel in PEERS   # dashed: a peer level with ours stays visible
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--" if peer else "o-",
                    markersize=4 if peer else 6, label=kernel,
                    color=OURS.get(kernel) or PEERS.get(kernel))
        flash = next((k for k in ("fa2", "fa3", "fa1") if k in lines), None)
        if "standard" in lines and flash:
            for n, mib in lines["standard"].items():
                if n in lines[flash]:
                    ax.annotate(f"{mib / lines[flash][n]:.0f}x", (n, mib), fontsize=7,
                                textcoords="offset points", xytext=(-6, 6))
        heads = {(r.get("batch"), r.get("heads")) for r in mine}
        batch, heads = next(iter(heads)) if len(heads) == 1 else ("?", "?")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ns = sorted({int(r["seqlen"]) for r in mine})
        ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
        ax.set_xlabel(f"sequence length (batch {batch}, {heads} heads)")
        ax.set_title(f"{pass_}, head_dim {d}, {'causal' if causal else 'not causal'}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("peak memory beyond the inputs (MiB)")
    axes[0][-1].legend(fontsize=7)
    _save(plt, fig, rows, "memory against sequence length", out)


FIGURES = {"speed": speed, "ablation": ablation, "decode": decode, "traffic": traffic,
           "traffic_seqlen": traffic_seqlen, "memory": memory}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--figure", choices=sorted(FIGURES), required=True)
    ap.add_argument("--out", default=None, help="the PNG (default: beside the CSV)")
    ap.add_argument("--ceiling", type=float, default=None, help="speed: a dashed TFLOP/s line")
    ap.add_argument("--pass", dest="pass_", default=None,
                    help="the rows of this pass only (fwd, bwd, fwd_bwd): speed, traffic")
    args = ap.parse_args(argv)
    rows = read(args.csv)
    if not rows:
        raise SystemExit(f"{args.csv} has no rows")
    if args.pass_:
        rows = [r for r in rows if (r.get("pass") or "fwd") == args.pass_]
        if not rows:
            raise SystemExit(f"{args.csv} has no rows of pass {args.pass_}")
    out = args.out or os.path.splitext(args.csv)[0] + f"_{args.figure}.png"
    if args.figure == "speed":
        speed(rows, out, args.ceiling)
    else:
        FIGURES[args.figure](rows, out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
