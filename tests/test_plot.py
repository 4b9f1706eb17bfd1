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


def test_speed_draws_one_pass_of_several(tmp_path):
    rows = grid_rows() + [dict(r, **{"pass": "fwd_bwd"}) for r in grid_rows()]
    path = write(tmp_path / "results.csv", rows)
    with pytest.raises(SystemExit, match="choose one with --pass"):
        plot.main([str(path), "--figure", "speed"])
    out = plot.main([str(path), "--figure", "speed", "--pass", "fwd_bwd"])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no rows of pass bwd"):
        plot.main([str(path), "--figure", "speed", "--pass", "bwd"])


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


def test_traffic_seqlen(tmp_path):
    """The same CSV against seqlen: standard as measured, fa1 and fa2 at one block each, failed
    rows left out."""
    rows = [dict(variant="standard", seqlen=n, head_dim=64, batch=16384 // n, heads=32, block="",
                 dram_bytes=2e9 * n / 1024, model_bytes=1.5e9 * n / 1024, compulsory_bytes=3e8,
                 status="ok", gpu="GPU X") for n in (1024, 4096)]
    rows += [dict(variant=v, seqlen=n, head_dim=64, batch=16384 // n, heads=32, block=b,
                  dram_bytes=1e8 * b, model_bytes=2e8 * b, compulsory_bytes=3e8, status="ok",
                  gpu="GPU X")
             for v in ("fa1", "fa2") for n in (1024, 4096) for b in (64, 128)]
    rows.append(dict(variant="fa2", seqlen=4096, head_dim=64, batch=4, heads=32, block=256,
                     dram_bytes="", model_bytes=1e9, compulsory_bytes=3e8, status="error: refused",
                     gpu="GPU X"))
    out = plot.main([str(write(tmp_path / "traffic.csv", rows)), "--figure", "traffic_seqlen"])
    assert out.endswith("traffic_traffic_seqlen.png")
    assert (tmp_path / "traffic_traffic_seqlen.png").stat().st_size > 1000


@pytest.mark.parametrize("figure", ["traffic", "traffic_seqlen"])
def test_traffic_of_forward_and_backward(tmp_path, figure):
    """`ncu.py traffic --pass fwd_bwd` rows (no model: NaN) drawn on their own; a CSV that holds
    both passes needs --pass."""
    def rows(pass_, model):
        return [dict(variant=v, **{"pass": pass_}, seqlen=n, head_dim=64, batch=16384 // n,
                     heads=32, block="" if v == "standard" else 128, dram_bytes=1e9 * n / 1024,
                     model_bytes=model, compulsory_bytes=3e8, status="ok", gpu="GPU X")
                for v in ("standard", "fa2") for n in (1024, 4096)]
    both = write(tmp_path / "t.csv", rows("fwd", 2e9) + rows("fwd_bwd", "nan"))
    with pytest.raises(SystemExit, match="choose one with --pass"):
        plot.main([str(both), "--figure", figure])
    out = plot.main([str(both), "--figure", figure, "--pass", "fwd_bwd"])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_traffic_seqlen_picks_and_annotates(monkeypatch):
    """fa2 drawn at B_r = 128 (its default), fa1 at its fewest-bytes block when 256 is missing;
    standard's measured bytes over fa2's written beside standard's points."""
    calls = []

    class Axes:
        def __getattr__(self, name):
            return lambda *a, **k: calls.append((name, a, k))

    class Plt:
        def subplots(self, *a, **k):
            return object(), Axes()

        def close(self, fig):
            pass

    monkeypatch.setattr(plot, "_pyplot", lambda: Plt())
    monkeypatch.setattr(plot, "_save", lambda *a: None)
    rows = [dict(variant="standard", seqlen=4096, head_dim=64, block="", dram_bytes="35e9",
                 model_bytes="26e9", compulsory_bytes="2.7e8", status="ok")]
    rows += [dict(variant="fa2", seqlen=4096, head_dim=64, block=str(b), dram_bytes=str(v),
                  model_bytes="1e9", compulsory_bytes="2.7e8", status="ok")
             for b, v in ((64, 2.7e8), (128, 2.5e8), (256, 6e9))]
    rows += [dict(variant="fa1", seqlen=4096, head_dim=64, block=str(b), dram_bytes=str(v),
                  model_bytes="1e9", compulsory_bytes="2.7e8", status="ok")
             for b, v in ((64, 2e10), (128, 1e10))]
    plot.traffic_seqlen(rows, "unused.png")
    lines = {k["label"]: a[1] for name, a, k in calls if name == "plot" and "label" in k}
    assert lines["fa2 (block 128) measured"] == [2.5e8]
    assert lines["fa1 (block 128) measured"] == [1e10]
    assert lines["standard measured"] == [35e9]
    notes = [a[0] for name, a, k in calls if name == "annotate"]
    assert notes == [f"{35e9 / 2.5e8:.0f}x"]
