"""The Hydra configs compose, name real variants, and drive experiments/run.py end to end."""
import csv
import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import variants
from common.tile import tiles
from experiments.run import COLUMNS, _options, resolve_problem
from tests.conftest import MODE

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def group(name):
    return sorted(p.stem for p in (CONF / name).glob("*.yaml"))


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("override", [f"{g}={c}" for g in ("variant", "problem", "dtype", "bench")
                                      for c in group(g)] + [f"experiment={e}" for e in group("experiment")])
def test_every_config_composes(override):
    cfg = composed(override)
    prob = resolve_problem(cfg, "gpu")
    assert prob["batch"] >= 1 and prob["heads"] >= 1 and prob["head_dim"] in tiles.HEAD_DIMS


def test_variant_configs_name_registered_variants_and_real_options():
    assert set(group("variant")) == set(variants.REGISTRY)
    for name in group("variant"):
        cfg = composed(f"variant={name}")
        assert cfg.variant.name == name
        module = variants.get(name)
        accepted = set(getattr(module, "OPTIONS", ()))
        assert set(cfg.variant.options) <= accepted, (name, set(cfg.variant.options) - accepted)
        # and every option is there, so that one override flips it (variant.options.<name>=...)
        assert accepted <= set(cfg.variant.options), (name, accepted - set(cfg.variant.options))
        # the backward's too, where the variant resolves them itself (fa1, fa2), and fa3's: its
        # kernel switch and its own kernel's options
        if hasattr(module, "default_backward_config"):
            assert set(cfg.variant.backward_options) == set(module.BACKWARD_OPTIONS), name
        if name in BACKWARD_KERNEL_OF:
            kernel = importlib.import_module(BACKWARD_KERNEL_OF[name])
            assert set(cfg.variant.backward_options) == {"kernel", *kernel.BACKWARD_OPTIONS}, name
    fa2 = variants.get("fa2")
    from variants import fa2_backward
    assert set(fa2.OPTIONS) <= {f.name for f in dataclasses.fields(fa2.Config)}
    assert set(fa2_backward.BACKWARD_OPTIONS) <= {
        f.name for f in dataclasses.fields(fa2_backward.BackwardConfig)}


# Variants whose backward_options (beside `kernel`, which picks the backward) are another module's
# BackwardConfig: fa3's own backward kernel.
BACKWARD_KERNEL_OF = {"fa3": "variants.fa3_backward"}


def written_options(name):
    """{section: {option: value}} of conf/variant/<name>.yaml as the file writes them (options,
    backward_options), not composed."""
    from omegaconf import OmegaConf
    node = OmegaConf.load(CONF / "variant" / f"{name}.yaml")
    return {section: OmegaConf.to_container(node[section]) if node.get(section) is not None
            else {} for section in ("options", "backward_options")}


def config_fields(name, section):
    """The fields of the Config a variant's section sets: its forward's Config, or the
    BackwardConfig its backward resolves (fa1, fa2: fa2's backward; fa3: its own)."""
    from variants import fa2_backward
    module = variants.get(name)
    if section == "options":
        config_class = getattr(module, "Config", None)
    elif name in BACKWARD_KERNEL_OF:
        config_class = importlib.import_module(BACKWARD_KERNEL_OF[name]).BackwardConfig
    else:
        config_class = fa2_backward.BackwardConfig if hasattr(module, "BACKWARD_OPTIONS") else None
    return set() if config_class is None else {f.name for f in dataclasses.fields(config_class)}


@pytest.mark.parametrize("name", group("variant"))
def test_variant_files_leave_every_default_to_the_code(name):
    """One source for each default, the code's: every option a variant file lists is a field of
    the Config it sets (an option, not a problem field; fa3's backward `kernel`: the switch of its
    backward) and is null, so that no value is written twice; and no comment restates one
    (`dry_run=true` prints them, from the code)."""
    from common.host import configs
    written = written_options(name)
    for section, options in written.items():
        fields = config_fields(name, section) - set(configs.PROBLEM_FIELDS)
        extra = {"kernel"} if section == "backward_options" and name in BACKWARD_KERNEL_OF else set()
        assert set(options) <= fields | extra, (name, section, set(options) - fields - extra)
        assert not fields or set(options) >= (fields if section == "options" or name != "fa1"
                                              else set(variants.get(name).BACKWARD_OPTIONS)), \
            (name, section, "options missing from the file")
        set_ = {k: v for k, v in options.items() if v is not None}
        assert not set_, f"conf/variant/{name}.yaml {section} sets {set_}: leave them null"
    text = (CONF / "variant" / f"{name}.yaml").read_text()
    assert "[default" not in text and not re.search(r"#.*\bdefault: ", text), \
        f"conf/variant/{name}.yaml restates a default"


def test_variant_file_check_sees_a_written_default(tmp_path, monkeypatch):
    """The check above fails on a value written into a variant file, and on a comment that
    restates a default."""
    text = (CONF / "variant" / "fa2.yaml").read_text()
    for bad in (text.replace("block_m: null", "block_m: 128", 1),
                text.replace("# B_r: query rows per thread block",
                             "# B_r: query rows per thread block [default: 128]", 1)):
        assert bad != text
        (tmp_path / "variant").mkdir(exist_ok=True)
        (tmp_path / "variant" / "fa2.yaml").write_text(bad)
        monkeypatch.setattr(sys.modules[__name__], "CONF", tmp_path)
        with pytest.raises(AssertionError):
            test_variant_files_leave_every_default_to_the_code("fa2")
        monkeypatch.undo()


def test_stated_defaults_follow_the_code():
    """dry_run's statement of a default over the head dims (configs.describe_default) is made from
    the resolved Configs: fa2's kv_stages at d=128 non-causal made 2 changes it."""
    from common.host import configs
    fa2 = variants.get("fa2")
    resolved = configs.resolved_defaults(fa2.default_config, fa2.HEAD_DIMS)
    assert configs.describe_default("kv_stages", resolved, list(fa2.HEAD_DIMS)) == \
        "1 at d=128 non-causal; else 2"
    resolved[128, False, None] = dataclasses.replace(resolved[128, False, None], kv_stages=2)
    assert configs.describe_default("kv_stages", resolved, list(fa2.HEAD_DIMS)) == "2"
    assert configs.describe_default("swizzle", resolved, list(fa2.HEAD_DIMS)) == \
        "true at d=56, 64, 120, 128, 248, 256; else false"


def test_dry_run_prints_the_resolved_configuration(tmp_path):
    """dry_run=true: the job's configuration with the defaults filled in, forward and backward,
    and nothing run (no results.csv)."""
    out = run(["dry_run=true", "variant=fa2", "problem.head_dim=128", "pass=fwd_bwd",
               "variant.options.warps=8", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    fa2 = variants.get("fa2")
    forward = fa2.default_config(128, "bfloat16", False, warps=8)
    backward = fa2.default_backward_config(128, "bfloat16", False)
    assert "forward configuration: " + " ".join(
        f"{k}={getattr(forward, k)}" for k in fa2.OPTIONS) in out.stdout
    assert "backward configuration: " + " ".join(
        f"{k}={getattr(backward, k)}" for k in fa2.BACKWARD_OPTIONS) in out.stdout
    assert "'head_dim': 128" in out.stdout and not (tmp_path / "run" / "results.csv").exists()
    assert "Numba CUDA simulator" not in out.stdout and "rows written" not in out.stdout


def test_dry_run_shows_every_field_and_runs_no_kernel(monkeypatch, capsys):
    """dry_run's Config, field by field: the problem's fields (a causal window with a softcap
    here), each option's value, whether the variant file left it null or the job set it, and its
    default over the head dims; with every path to a kernel of fa2's (forward, backward, build,
    launch) made to fail."""
    from experiments import run as job
    from variants import fa2_backward
    fa2 = variants.get("fa2")

    def refuse(*args, **kwargs):
        raise AssertionError("dry_run reached a kernel")

    for module, attr in ((fa2, "forward"), (fa2, "backward"), (fa2, "build"), (fa2, "launch"),
                         (fa2_backward, "build_backward"), (fa2_backward, "run_backward")):
        monkeypatch.setattr(module, attr, refuse)
    cfg = composed("variant=fa2", "dry_run=true", "pass=fwd_bwd", "problem.head_dim=96",
                   "problem.causal=true", "problem.window=[64,0]", "problem.softcap=30",
                   "variant.options.warps=8", "variant.backward_options.dq=separate")
    job.dry_run(cfg, "gpu")
    out = capsys.readouterr().out
    want = fa2.default_config(96, "bfloat16", True, (("window", True), ("softcap", True)), warps=8)
    assert "forward configuration: " + " ".join(
        f"{k}={getattr(want, k)}" for k in fa2.OPTIONS) + "\n" in out
    lines = {line.split()[0]: line.split(None, 2)[1:] for line in out.splitlines()
             if line.startswith("    ")}
    forward_part = out[:out.index("backward configuration")]
    forward_lines = {line.split()[0]: line.split(None, 2)[1:] for line in forward_part.splitlines()
                     if line.startswith("    ")}
    assert set(forward_lines) == {f.name for f in dataclasses.fields(fa2.Config)}
    for f in dataclasses.fields(fa2.Config):
        value, how = forward_lines[f.name]
        assert value == configs_show(getattr(want, f.name)), f.name
        assert how.startswith("the problem's" if f.name not in fa2.OPTIONS else
                              "set" if f.name == "warps" else "null  (default: "), (f.name, how)
    assert forward_lines["window"][0] == forward_lines["softcap"][0] == "true"
    assert forward_lines["kv_stages"][1] == "null  (default: 1 at d=128 non-causal; else 2)"
    assert forward_lines["warps"][1] == "set  (default: 4 at d=32..128; else 8)"
    backward = fa2.default_backward_config(96, "bfloat16", True,
                                           (("window", True), ("softcap", True)), dq="separate")
    assert "backward configuration: " + " ".join(
        f"{k}={getattr(backward, k)}" for k in fa2.BACKWARD_OPTIONS) + "\n" in out
    assert lines["dq"] == ["separate", "set  (default: atomic)"]


def test_dry_run_follows_fa3s_choice_of_backward_kernel(capsys):
    """fa3's backward: its own wgmma kernel where it takes the head dim, else FA2's, each with its
    own BackwardConfig (fa3.backward's kernel=None)."""
    from experiments import run as job
    from variants import fa2_backward, fa3_backward
    for head_dim, kernel, module in ((128, "wgmma", fa3_backward), (256, "fa2", fa2_backward)):
        job.dry_run(composed("variant=fa3", "pass=bwd", f"problem.head_dim={head_dim}"), "gpu")
        out = capsys.readouterr().out
        want = module.default_backward_config(head_dim, "bfloat16", False)
        assert f"backward configuration: kernel={kernel} " + " ".join(
            f"{k}={getattr(want, k)}" for k in module.BACKWARD_OPTIONS) + "\n" in out, out
        assert f"{module.__name__}.BackwardConfig, every field" in out


def configs_show(value):
    from common.host import configs
    return configs.show_value(value)


SMALL_JOB = ("problem.seqlen=16", "problem.heads=1", "problem.batch=1", "sim.problem.seqlen=16",
             "sim.problem.heads=1", "sim.problem.batch=1", "bench.peers=[]", "seed=0")


def test_job_logs_the_config_its_call_ran(monkeypatch, capsys):
    """The job's logged configuration (its printed line and the CSV's `config`) is the Config the
    variant's call resolved, read from the call (common/host/configs.py recorded), not resolved a
    second time beside it: a forward that resolves another configuration than the job's options
    say (block_n=32 added inside the call) is logged as it ran."""
    from experiments import run as job
    fa2 = variants.get("fa2")
    real = fa2.forward
    monkeypatch.setattr(fa2, "forward", lambda *a, **kw: real(*a, **dict(kw, block_n=32)))
    rows = job.run_job(composed("variant=fa2", *SMALL_JOB), MODE)
    ours = rows[0]
    assert ours["check"] == "ok", ours
    want = fa2.default_config(int(ours["head_dim"]), "bfloat16", False, block_n=32)
    assert ours["config"] == ";".join(f"{k}={getattr(want, k)}" for k in fa2.OPTIONS)
    assert "block_n=32" in ours["config"]
    assert f"fa2 configuration: {ours['config']}\n" in capsys.readouterr().out


@pytest.mark.parametrize("name,overrides", [
    ("fa2", ()),
    ("fa2", ("problem.causal=true", "problem.seqlen_k=24",
             "problem.window=[8,0]", "problem.softcap=4", "variant.options.warps=8")),
    ("fa1", ("problem.causal=true",))])
def test_dry_run_resolves_what_the_job_ran(name, overrides, capsys):
    """dry_run's Config for a job is the one the job's call resolved (every field, the problem's
    window and softcap too), and its one-line form is the job's logged `config`."""
    from common.host import configs
    from experiments import run as job
    cfg = composed(f"variant={name}", *SMALL_JOB, *overrides)
    module = variants.get(name)
    with configs.recorded() as ran:
        rows = job.run_job(cfg, MODE)
    assert rows[0]["check"] == "ok", rows[0]
    called = [c for c in ran if isinstance(c, module.Config)]
    options = job._options(cfg.variant.options)
    found = job.call_config(module, job.resolve_problem(cfg, MODE), cfg.dtype.name, options,
                            cfg.fp8)
    assert called == [found["config"]]
    capsys.readouterr()
    job.dry_run(cfg, MODE)
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("forward configuration: "))
    assert line == "forward configuration: " + rows[0]["config"].replace(";", " ")


def test_fa2_grid_sweeps_the_paper_grid():
    cfg = composed("experiment=fa2_grid")
    params = cfg.hydra.sweeper.params
    assert params["problem.seqlen"] == "512,1024,2048,4096,8192,16384"
    assert params["variant"] == "fa2,standard"
    prob = resolve_problem(composed("experiment=fa2_grid", "problem.seqlen=2048", "problem.head_dim=64"), "gpu")
    assert prob["batch"] * prob["seqlen"] == 16384 and prob["heads"] * prob["head_dim"] == 2048


def run(args, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if MODE == "sim":
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_main_job_checks_and_writes_a_row(tmp_path):
    out = run(["problem.seqlen=16", "problem.heads=1", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = read_rows(tmp_path / "run" / "results.csv")
    assert list(rows[0]) == COLUMNS
    ours = rows[0]
    assert ours["variant"] == "fa2" and ours["check"] == "ok" and ours["status"] == "ok"
    # what ran, defaults resolved: every fa2 option, with the value its default_config chose at
    # the job's head_dim (the problem's default: 64 in the simulator, 128 on a GPU)
    fa2 = variants.get("fa2")
    assert ours["head_dim"] == ("64" if MODE == "sim" else "128")
    want = fa2.default_config(int(ours["head_dim"]), "bfloat16", False)
    assert ours["config"] == ";".join(f"{k}={getattr(want, k)}" for k in fa2.OPTIONS)
    if MODE == "sim":
        assert "mean nothing" in out.stdout and ours["fwd_tflops"] == ""
    # one screen: what ran and where, the table, where the CSV went (no library logs)
    assert len(out.stdout.splitlines()) <= 12 and "][INFO]" not in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("variant", list(variants.REGISTRY))
def test_run_reads_every_variant_files_options(variant):
    """run.py reads `options` and `backward_options` of every variant file (fa1's had no
    backward_options, and every fa1 job failed on it, forward ones too, until a1b5f31)."""
    cfg = composed(f"variant={variant}")
    assert isinstance(_options(cfg.variant.get("options")), dict)
    assert isinstance(_options(cfg.variant.get("backward_options")), dict)


def test_speed_variants_sweeps_every_generation_and_pass():
    """experiment=speed_variants is issue 20's figure 1 in one command: every registered variant,
    the three passes, both head dims, causal and not, with the SDPA peers in the fa2 jobs."""
    cfg = composed("experiment=speed_variants")
    params = cfg.hydra.sweeper.params
    assert set(params["variant"].split(",")) == set(variants.REGISTRY)
    assert params["pass"] == "fwd,bwd,fwd_bwd" and params["problem.head_dim"] == "64,128"
    assert list(cfg.bench.peer_variants) == ["fa2"] and "sdpa_cudnn" in cfg.bench.peers


def test_fa1_job_runs(tmp_path):
    out = run(["variant=fa1", "problem.seqlen=16", "problem.heads=1",
               f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    row = read_rows(tmp_path / "run" / "results.csv")[0]
    assert row["variant"] == "fa1" and row["check"] == "ok"


def test_numba_and_cupy_log_quietly_unless_asked():
    """Hydra's job logging sends the root logger's INFO to the console; numba's CUDA driver logs
    an INFO line per freed event (1 261 lines in one GPU job), so it and cupy stay at WARNING."""
    loggers = composed().hydra.job_logging.loggers
    assert loggers.numba.level == "WARNING" and loggers.cupy.level == "WARNING"
    assert composed("hydra.verbose=numba").hydra.verbose == "numba"


@pytest.mark.slow
def test_parallel_sweep_writes_one_table(tmp_path):
    """hydra/launcher=gpus (experiments/gpus.py): the jobs run side by side in joblib's worker
    processes (two here; on a GPU host one per GPU, each pinned to its own) and their rows land
    in the sweep's one results.csv, one header."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")   # the 'sweeps' extra
    out = run(["-m", "hydra/launcher=gpus", "hydra.launcher.n_jobs=2", "variant=standard,fa2",
               "problem.seqlen=8", "problem.heads=1", "bench.peers=[]",
               f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr
    summary = out.stdout[out.stdout.index("== the sweep's results"):]   # the end-of-sweep table
    assert "seqlen" in summary and "standard" in summary and "fa2" in summary
    rows = read_rows(tmp_path / "sweep" / "results.csv")
    assert sorted(r["variant"] for r in rows) == ["fa2", "standard"]
    assert all(r["check"] == "ok" for r in rows)


PIN = """
import sys, time
from pathlib import Path
from experiments import gpus
print(gpus.pin_this_process(sys.argv[1]), flush=True)
while not Path(sys.argv[2]).exists():   # hold the GPU until the test has seen both
    time.sleep(0.05)
"""


def test_parallel_workers_take_one_gpu_each(tmp_path):
    """Two workers of a sweep at once get different GPUs, named as CUDA_VISIBLE_DEVICES names
    them, and each process sees only its own."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="5,GPU-7f3a", PYTHONPATH=str(ROOT))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", PIN, str(tmp_path / "locks"), str(go)],
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        taken = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        go.touch()
        for p in procs:
            p.wait(timeout=60)
            p.stdout.close()
    assert taken == ["5", "GPU-7f3a"]


def test_launchers_compose():
    """hydra/launcher=gpus: joblib with one worker per visible GPU (at least one);
    hydra/launcher=slurm: submitit's SLURM launcher, one GPU a job."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")   # the 'sweeps' extra
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    gpus = composed("hydra/launcher=gpus").hydra.launcher
    assert gpus._target_.endswith("JoblibLauncher") and gpus.n_jobs >= 1
    slurm = composed("hydra/launcher=slurm").hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.gpus_per_node == 1


@pytest.mark.slow
def test_backward_pass_job_checks_gradients(tmp_path):
    """pass=fwd_bwd: forward and backward timed together, dq, dk, dv checked against float64; under
    a mask set from the problem's keys (a causal window with a softcap, on a rectangle)."""
    out = run(["pass=fwd_bwd", "problem.seqlen=20", "problem.heads=1", "problem.causal=true",
               "problem.seqlen_k=28", "problem.window=[6,0]", "problem.softcap=4",
               "variant.backward_options.block_n=32", "variant.backward_options.warps=2",
               "variant.backward_options.block_m=64", "variant.backward_options.dq_block_m=32",
               "variant.backward_options.dq_warps=2", "variant.backward_options.dq_block_n=32",
               f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    row = read_rows(tmp_path / "run" / "results.csv")[0]
    assert row["pass"] == "fwd_bwd" and row["check"] == "ok" and row["fwd_ms"] == ""
    assert all(0 < float(row[f"{g}_err"]) < 8e-3 for g in ("dq", "dk", "dv"))
    assert "bwd.block_n=32" in row["options"]
    assert (row["window"], row["softcap"], row["align"]) == ("6,0", "4.0", "bottom_right")


@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd_bwd"])
def test_pass_fn_times_only_its_pass(pass_):
    """run.pass_fn over rotating input sets: bwd makes each set's forward once (prime(), before any
    timing) and times the backward alone; fwd_bwd runs the forward every call."""
    from experiments.run import pass_fn
    calls = []

    def forward(q, k, v):
        calls.append(("fwd", q))
        return f"o{q}", f"lse{q}"

    def backward(q, k, v, do, o, lse):
        calls.append(("bwd", q))
        assert (o, lse, do) == (f"o{q}", f"lse{q}", f"do{q}")   # this set's own forward
        return "grads"

    sets = [(j, None, None, f"do{j}") for j in range(3)]
    fn = pass_fn(pass_, forward, backward, sets)
    if pass_ == "bwd":
        fn.prime()
        assert calls == [("fwd", 0), ("fwd", 1), ("fwd", 2)]
        calls.clear()
    results = [fn(i) for i in range(7)]
    want = {"fwd": ["fwd"], "bwd": ["bwd"], "fwd_bwd": ["fwd", "bwd"]}[pass_]
    assert calls == [(kind, i % 3) for i in range(7) for kind in want]
    assert all(r[2] == (None if pass_ == "fwd" else "grads") for r in results)


def test_bad_pass_is_refused(tmp_path):
    out = run(["pass=backward", "problem.seqlen=8", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode != 0 and "pass must be one of fwd, bwd, fwd_bwd" in out.stderr


def test_ladder_rungs_are_the_papers_changes_in_order():
    from experiments.ladder import rung_number
    cfg = composed("experiment=ladder")
    rungs = cfg.hydra.sweeper.params["ladder"].split(",")
    assert rungs == sorted(group("ladder"), key=rung_number)
    steps = [composed(f"ladder={r}") for r in rungs]
    assert [s.label for s in steps] == rungs
    assert [composed("experiment=ladder", f"ladder={r}").bench.peer_variants for r in rungs] == \
        [[]] * 5 + [None] + [[]] * 6   # the peers are timed once per problem, with fa2 as it ships
    assert [s.variant.name for s in steps] == ["fa1"] * 4 + ["fa2"] * 2 + ["fa3"] * 6
    options = [{k: v for k, v in s.variant.options.items() if v is not None} for s in steps]
    assert options[:6] == [{}, {"q_splits": 0}, {"outer_loop": "q"},
                           {"outer_loop": "q", "deferred_rescale": True}, {"causal_skip": False}, {}]
    # FA3's rungs: each switches one technique on, r10 is fa3's defaults, r11 the paper's full kernel
    from variants import fa3
    switches = ("stages", "setmaxnreg", "pingpong", "persistent", "intra_overlap", "back_to_back")
    ladder = [{k: options[i][k] for k in switches} for i in range(6, 12)]
    assert ladder[0] == dict(stages=1, setmaxnreg=False, pingpong=False, persistent=False,
                             intra_overlap=False, back_to_back=False)
    changed = [{k for k in switches if b[k] != a[k]} for a, b in zip(ladder, ladder[1:])]
    assert changed == [{"stages"}, {"setmaxnreg"}, {"pingpong"}, {"persistent"}, {"intra_overlap"}]
    default = fa3.default_config(128, "bfloat16", False)
    assert all(ladder[4][k] == getattr(default, k) for k in switches)


def test_fa3_ablations_switch_one_technique_each():
    """experiment=fa3_ablations sweeps every conf/ablation/fa3_* at the FA3 paper's Table 2 shape;
    each sets fa3 options only, and differs from fa3's defaults."""
    from variants import fa3
    cfg = composed("experiment=fa3_ablations")
    swept = cfg.hydra.sweeper.params["ablation"].split(",")
    assert swept[0] == "none" and sorted(swept[1:]) == [a for a in group("ablation") if a.startswith("fa3_")]
    assert (cfg.variant.name, cfg.dtype.name, cfg.problem.batch, cfg.problem.seqlen, cfg.problem.heads) == \
        ("fa3", "float16", 4, 8448, 16)
    default = fa3.default_config(128, "float16", False)
    for name in swept[1:]:
        options = {k: v for k, v in composed("experiment=fa3_ablations", f"ablation={name}")
                   .variant.options.items() if v is not None}
        assert options and set(options) <= set(fa3.OPTIONS), name
        assert any(getattr(default, k) != v for k, v in options.items()), name


def test_ladder_report_tables_and_plots(tmp_path):
    from experiments import ladder
    path = tmp_path / "results.csv"
    rows = [dict(variant=v, label=label, head_dim=d, causal=c, seqlen=n, fwd_tflops=t, check="ok",
                 gpu="test GPU")
            for d in (64, 128) for c in (False, True) for n in (512, 1024)
            for v, label, t in [("fa1", "r0_fa1", 10.0), ("fa1", "r1_loop_order", 25.0),
                                ("fa2", "r2_x", 50.0), ("sdpa_flash", "r2_x", 40.0)]]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    assert ladder.main([str(path)]) == 0
    table = (tmp_path / "ladder.md").read_text().splitlines()
    assert table[0] == ("| head_dim | causal | seqlen | r0_fa1 | r1_loop_order | r2_x | sdpa_flash "
                        "| r1/r0 | r2/r1 | r2/r0 |")
    assert table[2] == "| 64 | no | 512 | 10.0 | 25.0 | 50.0 | 40.0 | 2.50 | 2.00 | 5.00 |"
    assert len(table) == 2 + 8 and (tmp_path / "ladder.png").stat().st_size > 10000


@pytest.mark.slow
def test_fp8_job_quantises_and_reports_rmse(tmp_path):
    """dtype=fp8: fp16 inputs (with outliers), quantised as cfg.fp8 says, fa3's FP8 forward checked
    against float64 with FP8's tolerances; the settings and the RMSE land in the CSV."""
    out = run(["variant=fa3", "dtype=fp8", "problem.seqlen=40", "problem.heads=1",
               "problem.outliers=0.01", "fp8.scaling=tensor", f"hydra.run.dir={tmp_path}/run"],
              tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    row = read_rows(tmp_path / "run" / "results.csv")[0]
    assert row["dtype"] == "float8_e4m3fn" and row["check"] == "ok" and row["head_dim"] == "128"
    assert "fp8.scaling=tensor" in row["options"] and "fp8.incoherent=True" in row["options"]
    assert 0 < float(row["rmse"]) < 0.2 and "block_n=256" in row["config"]


def test_fp8_job_for_a_variant_without_fp8_is_refused(tmp_path):
    out = run(["variant=fa2", "dtype=fp8", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode != 0 and "dtype=fp8 runs fa3's forward" in out.stderr


def test_once_per_config_keeps_a_layout_beside_the_fields():
    """configs.once_per_config: the layout is built once per configuration object, and neither
    equality, hashing nor repr (what the kernel cache keys on) sees it."""
    from common.hardware.elements import BFLOAT16
    from variants import fa2
    cfg = fa2.default_config(64, BFLOAT16, False)
    twin = dataclasses.replace(cfg)
    assert cfg.smem_layout() is cfg.smem_layout()
    assert cfg == twin and hash(cfg) == hash(twin) and repr(cfg) == repr(twin)
    assert twin.smem_layout() is not cfg.smem_layout()
    assert twin.smem_bytes() == cfg.smem_bytes()
