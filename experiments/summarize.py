"""Summarise results.csv files: TFLOP/s per problem and pass (fwd, bwd, fwd_bwd), one column per
kernel, and the ratios of fa2 and fa3 to torch SDPA's FlashAttention-2 (and fa3's to cuDNN's).

    python experiments/summarize.py multirun/<date>/<time>/results.csv [more.csv ...]
    python experiments/summarize.py --options results.csv    # one line per option setting (ablations)

Peers timed twice for one problem (in two jobs of a sweep) show the median of their rows.
"""
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from hydra.experimental.callback import Callback

ORDER = ["fa3", "fa2", "standard", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"]


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


def tflops(r):
    """A row's TFLOP/s for its pass (rows written before the `pass` column: the forward's)."""
    return r.get("tflops") or r.get("fwd_tflops") or ""


def table(rows):
    cells = defaultdict(list)
    status = {}
    for r in rows:
        key = (r.get("pass") or "fwd", r["dtype"], int(r["head_dim"]), r["causal"], int(r["seqlen"]))
        if tflops(r):
            cells[key, r["variant"]].append(float(tflops(r)))
        else:   # no time (an error, or the simulator's rows, whose times mean nothing)
            status[key, r["variant"]] = (r["status"].split(":")[0] if r["status"] != "ok"
                                         else r.get("check") or "ok")
        if r.get("check") == "FAIL":
            status[key, r["variant"]] = "FAIL"
    kernels = [k for k in ORDER if any(v == k for _, v in list(cells) + list(status))]
    keys = sorted({k for k, _ in list(cells) + list(status)})
    ratios = [("fa2", "sdpa_flash"), ("fa3", "sdpa_flash"), ("fa3", "sdpa_cudnn")]
    ratios = [(a, b) for a, b in ratios if a in kernels and b in kernels] or [("fa2", "sdpa_flash")]
    header = ["pass", "dtype", "hd", "causal", "seqlen"] + kernels + [
        f"{a}/{b.replace('sdpa_', '')}" for a, b in ratios]
    lines = [header]
    for key in keys:
        line = [key[0], key[1], str(key[2]), key[3], str(key[4])]
        for k in kernels:
            if (key, k) in status and status[key, k] == "FAIL":
                line.append("FAIL")
            elif cells.get((key, k)):
                line.append(f"{statistics.median(cells[key, k]):.1f}")
            else:
                line.append(status.get((key, k), "-"))
        for a, b in ratios:
            ours, peer = cells.get((key, a)), cells.get((key, b))
            line.append(f"{statistics.median(ours) / statistics.median(peer):.2f}"
                        if ours and peer else "-")
        lines.append(line)
    widths = [max(len(l[i]) for l in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines)


def options_table(rows):
    """One line per (problem, variant, options): for tile sweeps and ablations."""
    header = ["pass", "dtype", "hd", "causal", "seqlen", "variant", "options", "TFLOP/s", "ms",
              "peak MiB", "check"]
    lines = [header]
    for r in sorted(rows, key=lambda r: (r.get("pass") or "fwd", r["dtype"], int(r["head_dim"]),
                                         r["causal"], int(r["seqlen"]), r["variant"], r["options"])):
        lines.append([r.get("pass") or "fwd", r["dtype"], r["head_dim"], r["causal"], r["seqlen"],
                      r["variant"], r["options"] or "-", tflops(r) or r["status"],
                      r.get("ms") or r["fwd_ms"] or "-", r.get("peak_mem_mib") or "-",
                      r["check"] or "-"])
    widths = [max(len(l[i]) for l in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines)


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml): once every job of a multirun has run, the sweep's
    results.csv as one table, after the jobs' own lines."""

    def on_multirun_end(self, config, **kwargs):
        path = Path(config.hydra.sweep.dir) / "results.csv"
        if not path.exists():
            return
        rows = load([path])
        if rows:   # (TFLOP/s cells stay empty for the simulator's rows: its times mean nothing)
            print(f"== the sweep's results ({path}; python experiments/summarize.py {path})")
            print(table(rows))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--options":
        print(options_table(load(args[1:])))
    else:
        print(table(load(args)))
