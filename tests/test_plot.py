"""experiments/plot.py draws each figure from a small CSV in the experiments' own format (no GPU,
no re-run): a PNG that matplotlib wrote, for every figure the command offers."""
import csv

import pytest

from experiments import plot

RUN_COLUMNS = ["variant", "dtype", "head_dim", "causal", "seqlen", "fwd_tflops", "gpu", "check",
               "status", "job", "pass", "tflops"]


def write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def grid_rows():
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (512, 4096):
                for i, v in enumerate(("fa2", "sdpa_flash", "sdpa_cudnn")):
                    rows.append(dict(variant=v, dtype="bfloat16", head_dim=d, causal=causal,
                                     seqlen=n, fwd_tflops=100 + 50 * i + n / 100, gpu="GPU X",
                                     check="ok", status="ok", job="", **{"pass": "fwd"},
                                     tflops=""))
    return rows


def ablation_rows():
    return [dict(variant="fa2", dtype="bfloat16", head_dim=d, causal=c, seqlen=4096,
                 fwd_tflops=300 - 10 * i, gpu="GPU X", check="ok", status="ok",
                 job=f"ablation={a},problem.causal={c},problem.head_dim={d}", **{"pass": "fwd"},
                 tflops="")
            for d in (64, 128) for c in (False, True)
            for i, a in enumerate(("none", "no_pipeline", "padded"))]


def decode_rows():
    rows = []
    for b in (1, 8):
        for n in (4096, 131072):
            for k, gbs in (("decode (splits=8)", 2500), ("decode, no split", 800), ("fa2", 600),
                           ("sdpa_flash", 2900)):
                rows.append(dict(kernel=k, batch=b, seqlen_k=n, gbs=gbs, of_copy=gbs / 3000,
                                 host_us=100 if k.startswith("decode (") else "", gpu="GPU X"))
    return rows


def memory_rows():
    """experiment=bwd_memory's rows: standard quadratic, fa2 and sdpa_flash linear; a standard
    row that ran out of memory has no peak."""
    rows = [dict(variant=v, dtype="bfloat16", head_dim=128, causal=False, seqlen=n, batch=1,
                 heads=16, gpu="GPU X", check="ok", status="ok", **{"pass": "fwd_bwd"},
                 peak_mem_mib=mib)
            for n in (2048, 4096, 8192)
            for v, mib in (("standard", 800 * (n / 2048) ** 2), ("fa2", 48 * n / 2048),
                           ("sdpa_flash", 48 * n / 2048))]
    rows.append(dict(rows[0], seqlen=65536, peak_mem_mib="", status="out of memory"))
    return rows


@pytest.mark.parametrize("figure, rows", [("speed", grid_rows()), ("ablation", ablation_rows()),
                                          ("decode", decode_rows()), ("memory", memory_rows())])
def test_each_figure_is_drawn_from_its_csv(tmp_path, figure, rows):
    path = write(tmp_path / "results.csv", rows)
    out = plot.main([str(path), "--figure", figure, "--out", str(tmp_path / "f.png")] +
                    (["--ceiling", "790"] if figure == "speed" else []))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_memory_needs_a_measured_peak(tmp_path):
    path = write(tmp_path / "sim.csv", [dict(r, peak_mem_mib="") for r in memory_rows()])
    with pytest.raises(SystemExit, match="no row has a peak_mem_mib"):
        plot.main([str(path), "--figure", "memory"])


def test_an_empty_csv_is_refused(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("variant,seqlen\n")
    with pytest.raises(SystemExit, match="has no rows"):
        plot.main([str(path), "--figure", "speed"])


def test_speed_from_a_compare_configs_table(tmp_path):
    """compare_configs.py prints a table, not a CSV: plot.py reads it (the variant's defaults
    named after --variant, other configurations after their options, peers as they are, the GPU
    from the header) and draws the speed figure from it."""
    table = tmp_path / "grid.txt"
    table.write_text(
        "# fa3 beside SDPA, H100 80GB HBM3 (driver 580), 2026-11-23:\n"
        "#   python experiments/compare_configs.py '[{}]' --variant fa3 --seqlens 512,4096\n"
        "hd causal seqlen TFLOP/s median_ms check name\n"
        "128 0 512 302.7 (1.00) 0.2270 ok sdpa_flash\n"
        "128 0 512 359.0 (1.19) 0.1914 ok {}\n"
        '128 1 4096 300.0 (0.99) 0.9000 FAIL {"pingpong":false}\n'
        "64 1 4096 400.0 (1.30) 0.5000 ok {}\n")
    rows = plot.read(str(table))
    assert [(r["variant"], r["head_dim"], r["causal"], r["seqlen"], r["check"]) for r in rows] == [
        ("sdpa_flash", "128", "False", "512", "ok"), ("fa3", "128", "False", "512", "ok"),
        ("fa3 {\"pingpong\":false}", "128", "True", "4096", "FAIL"),
        ("fa3", "64", "True", "4096", "ok")]
    assert rows[1]["fwd_tflops"] == "359.0" and rows[0]["gpu"] == "H100 80GB HBM3"
    out = plot.main([str(table), "--figure", "speed", "--out", str(tmp_path / "s.png")])
    assert (tmp_path / "s.png").stat().st_size > 1000 and out.endswith("s.png")


def test_traffic(tmp_path):
    """experiments/ncu.py traffic's CSV: measured and modelled bytes against the block, standard as
    a line, failed rows left out."""
    rows = [dict(variant="standard", seqlen=n, head_dim=64, block="", dram_bytes=5e9,
                 model_bytes=9e9, compulsory_bytes=3e7, status="ok", gpu="GPU X")
            for n in (1024, 4096)]
    rows += [dict(variant=v, seqlen=n, head_dim=64, block=b, dram_bytes=1e8 * b,
                  model_bytes=2e8 * b, compulsory_bytes=3e7, status="ok", gpu="GPU X")
             for v in ("fa1", "fa2") for n in (1024, 4096) for b in (32, 64, 128)]
    rows.append(dict(variant="fa1", seqlen=4096, head_dim=64, block=256, dram_bytes="",
                     model_bytes=1e9, compulsory_bytes=3e7, status="error: refused", gpu="GPU X"))
    csv_path = write(tmp_path / "traffic.csv", rows)
    plot.main([str(csv_path), "--figure", "traffic"])
    assert (tmp_path / "traffic_traffic.png").stat().st_size > 1000
