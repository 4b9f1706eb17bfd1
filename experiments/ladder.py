"""The FA1 -> FA2 -> FA3 ladder's report: a table of each rung's TFLOP/s and its speed-up over the
rung before, and a plot of TFLOP/s vs seqlen (one line per rung, plus the torch SDPA peers timed:
its FlashAttention-2 and cuDNN kernels).

    python experiments/run.py -m experiment=ladder          # writes both next to the sweep's CSV
    python experiments/ladder.py results.csv [--out DIR]    # again, from a CSV

Rungs are the `label`s of the rows (conf/ladder/), in the order of their numbers (r0_..., r1_...,
r10_...).
"""
import argparse
import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from hydra.experimental.callback import Callback

PEERS = ("sdpa_flash", "sdpa_cudnn")   # in this order where timed


def rung_number(label):
    """r10_persistent -> 10 (the rungs' order; their names sort r1 < r10 < r2 as text)."""
    match = re.match(r"r(\d+)", label)
    return (int(match.group(1)) if match else 1 << 30, label)


def load(path):
    """{(head_dim, causal, seqlen): {rung or peer: TFLOP/s}} and the rungs in order."""
    cells = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for r in csv.DictReader(f):
            name = r["variant"] if r["variant"].startswith("sdpa") else r.get("label") or r["variant"]
            if r["fwd_tflops"] and r["check"] != "FAIL":
                cells[int(r["head_dim"]), r["causal"] == "True", int(r["seqlen"])][name].append(
                    float(r["fwd_tflops"]))
    table = {k: {n: statistics.median(v) for n, v in row.items()} for k, row in cells.items()}
    rungs = sorted({n for row in table.values() for n in row if not n.startswith("sdpa")},
                   key=rung_number)
    return table, rungs


def peers_in(table):
    return [p for p in PEERS if any(p in row for row in table.values())]


def markdown(table, rungs):
    """TFLOP/s of every rung and the peer, then each rung's speed-up over the one before, and the
    last rung's over the first (the FA2 paper's fa2 / fa1)."""
    peers = peers_in(table)
    head = ["head_dim", "causal", "seqlen"] + rungs + peers
    head += [f"{b.split('_')[0]}/{a.split('_')[0]}" for a, b in zip(rungs, rungs[1:])]
    head += [f"{rungs[-1].split('_')[0]}/{rungs[0].split('_')[0]}"] if len(rungs) > 1 else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (d, causal, n), row in sorted(table.items()):
        cells = [str(d), "yes" if causal else "no", str(n)]
        cells += [f"{row[x]:.1f}" if x in row else "-" for x in rungs + peers]
        pairs = list(zip(rungs, rungs[1:])) + ([(rungs[0], rungs[-1])] if len(rungs) > 1 else [])
        cells += [f"{row[b] / row[a]:.2f}" if a in row and b in row else "-" for a, b in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table, rungs, path, title=""):
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(d, c) for d, c, _ in table})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        points = sorted((n, row) for (dd, cc, n), row in table.items() if (dd, cc) == (d, causal))
        for name in rungs + peers_in(table):
            xs = [n for n, row in points if name in row]
            peer = name.startswith("sdpa")
            ax.plot(xs, [row[name] for n, row in points if name in row], marker="o", markersize=3,
                    linestyle=(":" if "cudnn" in name else "--") if peer else "-",
                    color="black" if peer else None, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")   # the rungs span two orders of magnitude
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([n for n, _ in points], [f"{n // 1024}k" if n >= 1024 else str(n) for n, _ in points])
        ax.set_title(f"head_dim {d}, {'causal' if causal else 'not causal'}")
        ax.set_xlabel("seqlen (batch x seqlen = 16k)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("forward TFLOP/s")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def report(csv_path, out_dir=None):
    csv_path = Path(csv_path)
    out_dir = Path(out_dir or csv_path.parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    table, rungs = load(csv_path)
    if not table:
        print(f"ladder: no timed rows in {csv_path}")
        return None
    with open(csv_path) as f:
        gpu = next(csv.DictReader(f)).get("gpu", "")
    (out_dir / "ladder.md").write_text(markdown(table, rungs))
    plot(table, rungs, out_dir / "ladder.png", title=f"FA1 -> FA2 -> FA3 ladder, bf16, {gpu}")
    print(markdown(table, rungs))
    print(f"ladder table and plot written to {out_dir}/ladder.md, ladder.png")
    return out_dir


class LadderReport(Callback):
    """Hydra callback of experiment=ladder: the report, once every job of the sweep has run."""

    def on_multirun_end(self, config, **kwargs):
        path = Path(config.hydra.sweep.dir) / "results.csv"
        if path.exists():
            report(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--out", help="folder for ladder.md and ladder.png (default: the CSV's)")
    args = parser.parse_args(argv)
    return 0 if report(args.csv, args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
