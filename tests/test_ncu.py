"""experiments/ncu.py: the ncu CSV parser on output in ncu's own format, a configuration's row from a
profiled run (the model's bytes beside the measured ones; errors and out-of-memory recorded), and
the message when ncu is missing. The profiled call itself runs in the simulator (without the
profiler range)."""
import csv
import json
import math

import pytest

from experiments import io_model, ncu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def ncu_output(kernels):
    """What `ncu --csv --print-units base` prints for kernels [(name, read, write, ns)]."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
             '==PROF== Profiling "fa2_forward" - 0: 0%....50%....100% - 3 passes', HEADER]
    for i, (name, read, write, ns) in enumerate(kernels):
        for metric, unit, value in (("dram__bytes_read.sum", "byte", read),
                                    ("dram__bytes_write.sum", "byte", write),
                                    ("gpu__time_duration.sum", "nsecond", ns)):
            lines.append(f'"{i}","4242","python3.12","127.0.0.1","{name}","1","7","(128, 1, 1)",'
                         f'"(32, 1, 16)","0","9.0","Command line profiler metrics","{metric}",'
                         f'"{unit}","{value:,}"')
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


class Done:
    def __init__(self, stdout="", stderr="", returncode=0):
        self.stdout, self.stderr, self.returncode = stdout, stderr, returncode


def test_parse_reads_each_launch_and_its_metrics():
    text = ncu_output([("scores", 6_526_303_488, 4_290_124_544, 36_904_256),
                       ("row_softmax", 1_000, 2_000, 3_000)])
    launches = ncu.parse_csv(text)
    assert [x["kernel"] for x in launches] == ["scores", "row_softmax"]
    assert launches[0]["dram__bytes_read.sum"] == 6_526_303_488
    assert launches[1]["gpu__time_duration.sum"] == 3_000
    assert ncu.parse_csv("==PROF== no kernels were profiled\n") == []


def test_a_row_sums_the_call_and_puts_the_model_beside_it():
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return Done(ncu_output([("fa2_forward", 200_000_000, 60_000_000, 1_750_000),
                                ("fill", 1_000_000, 4_000_000, 10_000)]))

    row = ncu.measure("fa2", 4096, 64, 64, 2, 16, False, run=run)
    cmd = calls[0]
    assert cmd[:2] == ["ncu", "--csv"] and "--profile-from-start" in cmd and "off" in cmd
    assert json.loads(cmd[cmd.index("--options") + 1]) == {"block_m": 64}
    assert row["kernels"] == 2 and row["status"] == "ok"
    assert row["dram_read"] == 201_000_000 and row["dram_bytes"] == 265_000_000
    assert row["gpu_ms"] == pytest.approx(1.76)
    assert row["model_bytes"] == io_model.fa2_bytes(4096, 64, 64) * 2 * 16
    assert row["compulsory_bytes"] == 4 * 4096 * 64 * 2 * 2 * 16
    std = ncu.measure("standard", 1024, 64, None, 1, 1, False, run=run)
    assert std["options"] == "{}" and std["model_bytes"] == io_model.standard_bytes(1024, 64)


def test_a_forward_and_backward_row_counts_both_passes_compulsory_bytes(tmp_path):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return Done(ncu_output([("fa2_forward", 10, 20, 1000), ("fa2_backward_kv", 30, 40, 2000)]))

    row = ncu.measure("fa2", 2048, 64, 128, 1, 4, False, run=run, pass_="fwd_bwd")
    assert calls[0][calls[0].index("--pass") + 1] == "fwd_bwd"
    assert row["pass"] == "fwd_bwd" and row["dram_bytes"] == 100 and row["kernels"] == 2
    assert row["compulsory_bytes"] == 12 * 2048 * 64 * 2 * 4   # Q K V O; Q K V O dO; dQ dK dV
    assert math.isnan(row["model_bytes"])                      # the IO model is the forward's
    path = tmp_path / "t.csv"
    rows = ncu.traffic(["fa2"], [512, 1024], 64, [64], 1, 1, False, run=run, pass_="fwd_bwd",
                       csv_path=str(path))
    with open(path) as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) == 2 and {r["pass"] for r in written} == {"fwd_bwd"}


def test_errors_and_out_of_memory_are_recorded():
    oom = ncu.measure("standard", 65536, 64, None, 1, 16, False,
                      run=lambda cmd, **kw: Done(stderr="torch.OutOfMemoryError: CUDA out of "
                                                        "memory. Tried to allocate 16 GiB",
                                                 returncode=1))
    assert oom["status"] == "out of memory" and oom["kernels"] == 0
    bad = ncu.measure("fa1", 1024, 64, 48, 1, 1, False,
                      run=lambda cmd, **kw: Done(stderr="ValueError: block_n must be ...",
                                                 returncode=1))
    assert bad["status"].startswith("error: ValueError")


def test_traffic_without_ncu_says_so():
    with pytest.raises(SystemExit, match="not on PATH"):
        ncu.traffic(["fa2"], [256], 64, [64], 1, 1, False, ncu="no-such-ncu-here")


def test_traffic_sweeps_blocks_of_blocked_variants_only(capsys):
    seen = []

    def run(cmd, **kw):
        seen.append(json.loads(cmd[cmd.index("--options") + 1]))
        return Done(ncu_output([("k", 10, 20, 1000)]))

    rows = ncu.traffic(["standard", "fa1", "fa2"], [512], 64, [32, 64], 1, 1, False, run=run)
    assert seen == [{}, {"block_n": 32}, {"block_n": 64}, {"block_m": 32}, {"block_m": 64}]
    assert len(rows) == 5 and "fa1" in capsys.readouterr().out


@pytest.mark.sim
def test_the_profiled_call_runs():
    """`ncu.py call`: the variant's forward with the block option, twice (the profiler range is
    the GPU's; the simulator runs the call alone)."""
    ncu.call("fa1", 16, 64, 1, 1, False, {"block_n": 64})


@pytest.mark.sim
def test_the_profiled_forward_and_backward_runs():
    ncu.call("fa2", 16, 64, 1, 1, True, {}, pass_="fwd_bwd")
    with pytest.raises(ValueError, match="pass must be one of"):
        ncu.call("fa2", 16, 64, 1, 1, True, {}, pass_="bwd_only")


def raw_output(kernels):
    """What `ncu -i REP --csv --page raw --print-units base` prints: metric names, units, a row a
    launch (kernels: [(name, {metric: value})])."""
    names = sorted({m for _, metrics in kernels for m in metrics})
    lines = ["==PROF== imported report", ",".join(f'"{x}"' for x in ["ID", "Kernel Name", *names]),
             ",".join(f'"{x}"' for x in ["", "", *("" for _ in names)])]
    for i, (kernel, metrics) in enumerate(kernels):
        lines.append(",".join(f'"{x}"' for x in [i, kernel, *(f"{metrics.get(m, 0):,}" for m in names)]))
    return "\n".join(lines) + "\n"


def test_profile_reports_the_longest_kernel_of_each_call(tmp_path):
    kernels = {"fa3": [("fa3_forward", {"gpu__time_duration.sum": 850_000,
                                        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 0.5,
                                        "launch__registers_per_thread": 168, "not_headline": 3})],
               "sdpa_cudnn": [("fill", {"gpu__time_duration.sum": 2_000}),
                              ("cudnn_fmha", {"gpu__time_duration.sum": 800_000,
                                              "launch__registers_per_thread": 128})]}
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        if "-o" in cmd:   # the profiled call: which name it ran
            run.name = cmd[cmd.index("--variant") + 1]
            return Done()
        return Done(raw_output(kernels[run.name]) if "raw" in cmd else "source")

    results = ncu.profile(["fa3", "sdpa_cudnn"], 4096, 128, 4, 16, False, {"pingpong": False},
                          str(tmp_path), run=run)
    assert results["fa3"]["gpu__time_duration.sum"] == 850_000
    assert "not_headline" not in results["fa3"]
    assert results["sdpa_cudnn"]["kernel"] == "cudnn_fmha"
    assert results["sdpa_cudnn"]["launch__registers_per_thread"] == 128
    profiled = [c for c in calls if "-o" in c]
    assert json.loads(profiled[0][profiled[0].index("--options") + 1]) == {"pingpong": False}
    assert json.loads(profiled[1][profiled[1].index("--options") + 1]) == {}   # a peer: no options
    assert (tmp_path / "fa3_raw.csv").exists() and (tmp_path / "sdpa_cudnn_source.csv").exists()
    assert all(c[c.index("--pass") + 1] == "fwd" for c in profiled)
    ncu.print_profile(results)
    calls.clear()   # --pass fwd_bwd reaches every profiled call (the backward's kernel is longest)
    ncu.profile(["fa3", "sdpa_cudnn"], 4096, 128, 4, 16, False, {}, str(tmp_path), run=run,
                pass_="fwd_bwd")
    assert [c[c.index("--pass") + 1] for c in calls if "-o" in c] == ["fwd_bwd", "fwd_bwd"]


def test_opcode_mix_counts_each_kernels_executed_sass_by_opcode(tmp_path, capsys):
    """`ncu.py opcodes` on a source page in ncu's CSV shape: a kernel's section, a header row, a row
    a SASS line (predicated lines count under their opcode; thousands separators read)."""
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
              '"Thread Instructions Executed"')
    text = "\n".join([
        '"Kernel Name","fa2_backward_kv(Array<...>)"', header,
        '"0x10","      IMAD.SHL.U32 R2, R246, 0x20, RZ","12","1,048,576","33,554,432"',
        '"0x20","      HMMA.16816.F32.BF16 R172, R184, R156, RZ","30","2,097,152","67,108,864"',
        '"0x30","      @!P0 IMAD R33, R2, UR40, RZ","3","1,048,576","1"',
        '"0x40","      @UP1 UIADD3 UR38, UR7, 0x1, URZ","0","1,048,576","1"',
        '"Kernel Name","flash_bwd_dq_dk_dv"', header,
        '"0x10","      LEA R44, P3, R32, UR30, 0x2","5","524,288","1"',
    ])
    path = tmp_path / "source.csv"
    path.write_text(text)
    kernels = ncu.main(["opcodes", str(path), "--per", "1048576"])
    (first, ops), (second, ops2) = kernels
    assert first.startswith("fa2_backward_kv") and second == "flash_bwd_dq_dk_dv"
    assert ops == {"IMAD": [2_097_152, 15], "HMMA": [2_097_152, 30], "UIADD3": [1_048_576, 0]}
    assert ops2 == {"LEA": [524_288, 5]}
    out = capsys.readouterr().out
    assert "IMAD" in out and "2.0" in out and "40.00%" in out   # 2 a step; 2M of 5M executed
