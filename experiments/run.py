"""Run one attention variant on one problem: check it against float64, time it, time the peers.

    python experiments/run.py variant=fa2
    python experiments/run.py variant=standard problem.seqlen=2048 dtype=fp16
    python experiments/run.py -m variant=standard,fa2 problem.seqlen=1024,4096
    python experiments/run.py -m experiment=fa2_grid

Each job: compose the config -> draw inputs (fresh seed unless seed=...) -> run the variant ->
compare with the float64 reference -> time it (CUDA events, warm-up, median) -> when torch sees a
GPU, check and time the torch SDPA backends on the same tensors -> print a table -> write one CSV
row per kernel to results.csv in Hydra's output directory (and, in a sweep, to the sweep's
results.csv). Without a CUDA GPU the same kernels run in Numba's CUDA simulator on a small problem.
"""
import csv
import math
import os
import sys
import time
import traceback
from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import common  # noqa: E402  (light: chooses GPU or simulator before numba loads)

COLUMNS = ["variant", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "fwd_ms",
           "fwd_tflops", "gpu", "seqlen_k", "heads_kv", "fwd_ms_min", "fwd_ms_max", "reps",
           "rel_err", "max_err", "lse_err", "check", "status", "mode", "library", "options",
           "label", "seed", "job"]

SIM_BANNER = ("No CUDA GPU here: the kernels run in Numba's CUDA simulator, on a small problem, and "
              "are checked against float64 exactly as on a GPU.\nThe times printed are the "
              "simulator's Python wall-clock: they mean nothing about kernel speed.")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    mode = _select_backend(cfg.device)
    rows = run_job(cfg, mode)
    _write_rows(rows)
    bad = [r for r in rows if r["check"] == "FAIL" or r["status"].startswith("error")]
    if bad and cfg.bench.fail_on_error:
        names = ", ".join(f"{r['variant']} ({r['status']}, check {r['check']})" for r in bad)
        raise RuntimeError(f"failed: {names}")
    return rows


def _select_backend(device):
    if device not in ("auto", "gpu", "sim"):
        raise ValueError(f"device must be auto, gpu or sim, got {device!r}")
    if device != "auto" and "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if device == "sim" else "0"
    mode = common.select_backend()
    if device != "auto" and mode != device:
        raise RuntimeError(f"device={device} was asked for, but this process already runs on {mode}")
    if mode == "gpu":
        from common.target import gpu_available
        if not gpu_available():
            raise RuntimeError("device=gpu but no CUDA GPU is usable (NUMBA_ENABLE_CUDASIM=0)")
    return mode


def resolve_problem(cfg, mode):
    """The problem's shape: batch and heads follow from tokens and hidden when not given (the FA2
    paper's grid keeps batch * seqlen = 16k and heads * head_dim = 2048)."""
    p = OmegaConf.to_container(cfg.problem, resolve=True)
    if mode == "sim" and not cfg.sim.full_problem:
        # The simulator's small problem, except where the command line set a problem key itself.
        asked = {o.split("=")[0].lstrip("+~") for o in _task_overrides()}
        p.update({k: v for k, v in OmegaConf.to_container(cfg.sim.problem, resolve=True).items()
                  if f"problem.{k}" not in asked})
    seqlen, head_dim = int(p["seqlen"]), int(p["head_dim"])
    batch = p.get("batch") or max(1, int(p["tokens"]) // seqlen)
    heads = p.get("heads") or max(1, int(p["hidden"]) // head_dim)
    return dict(batch=int(batch), seqlen=seqlen, heads=int(heads), head_dim=head_dim,
                causal=bool(p["causal"]), seqlen_k=int(p.get("seqlen_k") or seqlen),
                heads_kv=int(p.get("heads_kv") or heads), softmax_scale=p.get("softmax_scale"))


def run_job(cfg, mode):
    import variants
    from common import inputs, reference, target
    from experiments import peers

    prob = resolve_problem(cfg, mode)
    dtype = cfg.dtype.name
    seed = int(cfg.seed) if cfg.seed is not None else inputs.fresh_seed()
    rng = np.random.default_rng(seed)
    library = inputs.default_library() if cfg.library == "auto" else cfg.library
    if mode == "sim":
        print(SIM_BANNER)
    print(f"{target.describe()} | {prob} | {dtype} | inputs: {library} | seed {seed}")

    shape = dict(batch=prob["batch"], seqlen=prob["seqlen"], heads=prob["heads"],
                 head_dim=prob["head_dim"], dtype=dtype, seqlen_k=prob["seqlen_k"],
                 heads_kv=prob["heads_kv"])
    host = inputs.random_qkv(rng, **shape)
    # Rotate input sets so that repeated timing runs do not all hit a warm L2 cache.
    set_bytes = sum(x.nbytes for x in host)
    n_sets = 1 if mode == "sim" else int(min(cfg.bench.max_input_sets,
                                             max(1, math.ceil(cfg.bench.rotate_bytes / set_bytes))))
    sets = [tuple(inputs.to_device(x, library) for x in host)]
    sets += [tuple(inputs.to_device(x, library) for x in inputs.random_qkv(rng, **shape))
             for _ in range(n_sets - 1)]

    n_q = prob["seqlen"]
    check_rows = np.arange(n_q)
    if n_q > cfg.bench.check_rows:
        check_rows = np.unique(np.concatenate([[0, n_q - 1], rng.choice(n_q, cfg.bench.check_rows,
                                                                        replace=False)]))
    ref = reference.attention(*host, causal=prob["causal"], softmax_scale=prob["softmax_scale"],
                              rows=check_rows)

    ctx = dict(prob=prob, dtype=dtype, sets=sets, ref=ref, check_rows=check_rows, mode=mode,
               library=library, seed=seed, gpu=target.describe(), bench=cfg.bench,
               job=_job_name(), label=cfg.get("label") or "")
    options = {k: v for k, v in OmegaConf.to_container(cfg.variant.get("options", {})).items()
               if v is not None}
    module = variants.get(cfg.variant.name)

    def ours(q, k, v):
        return module.forward(q, k, v, causal=prob["causal"], softmax_scale=prob["softmax_scale"],
                              **options)

    rows = [measure(cfg.variant.name, ours, ctx, options=options,
                    workspace=_workspace(module, prob))]
    peer_jobs = cfg.bench.peer_variants
    if peers.available() and mode == "gpu" and library == "torch" and (
            peer_jobs is None or cfg.variant.name in peer_jobs):
        for name in cfg.bench.peers:
            fn = peers.forward_fn(name, prob["causal"], prob["softmax_scale"],
                                  gqa=prob["heads"] != prob["heads_kv"])
            rows.append(measure(name, fn, ctx))
    print_table(rows)
    return rows


def _workspace(module, prob):
    fn = getattr(module, "workspace_bytes", None)
    return fn(prob["batch"], prob["heads"], prob["seqlen"], prob["seqlen_k"]) if fn else 0


def measure(name, fn, ctx, options=None, workspace=0):
    """Check fn on the first input set, then time it rotating over all sets: one CSV row."""
    from common import checks, flops, inputs, timing

    prob, bench = ctx["prob"], ctx["bench"]
    row = dict(variant=name, dtype=ctx["dtype"], head_dim=prob["head_dim"],
               causal=prob["causal"], seqlen=prob["seqlen"], batch=prob["batch"],
               heads=prob["heads"], gpu=ctx["gpu"], seqlen_k=prob["seqlen_k"],
               heads_kv=prob["heads_kv"], mode=ctx["mode"], library=ctx["library"],
               options=";".join(f"{k}={v}" for k, v in (options or {}).items()),
               label=ctx["label"], seed=ctx["seed"], job=ctx["job"], check="", status="ok")
    free = _free_device_bytes(ctx)
    if workspace and free is not None and workspace > free:
        row["status"] = f"skipped: needs {workspace / 2**30:.1f} GiB of work memory"
        return row
    sets = ctx["sets"]
    try:
        started = time.perf_counter()
        out = fn(*sets[0])
        first_ms = (time.perf_counter() - started) * 1e3
        o, lse = out if isinstance(out, tuple) else (out, None)
        has_lse = lse is not None   # torch SDPA does not return the log-sum-exp
        rows_ = ctx["check_rows"]
        o_host = inputs.to_host(o)[:, rows_]
        lse_host = inputs.to_host(lse)[:, :, rows_] if has_lse else ctx["ref"][1]
        result = checks.compare(o_host, lse_host, *ctx["ref"], ctx["dtype"])
        del out, o, lse
        row.update(rel_err=f"{result['rel_err']:.3e}", max_err=f"{result['max_err']:.3e}",
                   lse_err=f"{result['lse_err']:.3e}" if has_lse else "",
                   check="ok" if result["ok"] else "FAIL")
        if ctx["mode"] == "sim":   # one simulated run is slow enough; its time means nothing
            t = timing.Timing(first_ms, first_ms, first_ms, 1, simulated=True)
        else:
            t = timing.benchmark(lambda i: fn(*sets[i % len(sets)]), warmup=bench.warmup,
                                 min_reps=bench.min_reps, max_reps=bench.max_reps,
                                 target_ms=bench.target_ms)
        total = flops.attention_flops(prob["batch"], prob["heads"], prob["seqlen"],
                                      prob["seqlen_k"], prob["head_dim"], prob["causal"])
        row.update(fwd_ms=f"{t.median_ms:.4f}", fwd_ms_min=f"{t.min_ms:.4f}",
                   fwd_ms_max=f"{t.max_ms:.4f}", reps=t.reps,
                   fwd_tflops="" if t.simulated else f"{total / t.median_ms / 1e9:.1f}")
    except Exception as exc:  # one kernel's failure must not hide the others' rows
        if _is_out_of_memory(exc):
            row["status"] = "oom"
        else:
            traceback.print_exc()
            row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        _release_memory(ctx["library"])
    return row


def _is_out_of_memory(exc):
    text = f"{type(exc).__name__} {exc}".lower()
    return "out of memory" in text or "out_of_memory" in text or "outofmemory" in text


def _free_device_bytes(ctx):
    if ctx["mode"] != "gpu":
        return None
    _release_memory(ctx["library"])
    from numba import cuda
    return cuda.current_context().get_memory_info()[0]


def _release_memory(library):
    if library == "torch":
        import torch
        torch.cuda.empty_cache()
    elif library == "cupy":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


def print_table(rows):
    cols = ["variant", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "fwd_ms",
            "fwd_tflops", "rel_err", "check", "status"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(widths[c]) for c in cols))


def _task_overrides():
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def _job_name():
    try:
        hc = HydraConfig.get()
    except ValueError:
        return ""
    return hc.job.override_dirname or hc.job.name


def _write_rows(rows):
    try:
        hc = HydraConfig.get()
    except ValueError:
        return
    paths = [Path(hc.runtime.output_dir) / "results.csv"]
    if hc.mode == RunMode.MULTIRUN:
        paths.append(Path(hc.sweep.dir) / "results.csv")
    for path in paths:
        new = not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerows(rows)
        print(f"rows written to {path}")


if __name__ == "__main__":
    main()
