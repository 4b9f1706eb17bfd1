"""Run one attention variant on one problem: check it against float64, time it, time the peers.

    python experiments/run.py variant=fa2
    python experiments/run.py variant=standard problem.seqlen=2048 dtype=fp16
    python experiments/run.py -m variant=standard,fa2 problem.seqlen=1024,4096
    python experiments/run.py -m experiment=fa2_grid
    python experiments/run.py pass=fwd_bwd          # forward + backward (or pass=bwd: backward only)
    python experiments/run.py variant=fa3 dtype=fp8 fp8.incoherent=false problem.outliers=0.001
    python experiments/run.py -m experiment=fp8_accuracy   # the FA3 paper's FP8 error table

Each job: compose the config -> draw inputs (fresh seed unless seed=...) -> run the variant ->
compare with the float64 reference -> time it (CUDA events, warm-up, median) -> when torch sees a
GPU, check and time the torch SDPA backends on the same tensors -> print a table -> write one CSV
row per kernel to results.csv in Hydra's output directory (and, in a sweep, to the sweep's
results.csv). Without a CUDA GPU the same kernels run in Numba's CUDA simulator on a small problem.

`pass` picks what is timed: fwd (the forward), bwd (the backward alone, from a forward run
beforehand; SDPA's through torch.autograd.grad with the graph kept) or fwd_bwd (both). With a
backward, dq, dk, dv of batch 0's first K/V head (and its query heads) are checked against float64
too, and with torch inputs the peak device memory a call allocates beyond its inputs is recorded.
"""
import csv
import dataclasses
import fcntl
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
from experiments import gpus  # noqa: E402  (light too: pins a sweep's worker to a GPU)

# hydra/launcher=gpus runs one worker per visible GPU (conf/hydra/launcher/gpus.yaml)
OmegaConf.register_new_resolver("fa_gpus", gpus.worker_count, replace=True)

COLUMNS = ["variant", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "fwd_ms",
           "fwd_tflops", "gpu", "seqlen_k", "heads_kv", "fwd_ms_min", "fwd_ms_max", "reps",
           "rel_err", "max_err", "lse_err", "check", "status", "mode", "library", "options",
           "label", "seed", "job",
           # the forward's configuration as it ran: every option of the Config its call resolved
           # (common/host/configs.py recorded), the options above over the variant's defaults
           "config",
           # the pass timed (fwd, bwd, fwd_bwd) and its times (fwd_* above: pass=fwd only)
           "pass", "ms", "tflops", "ms_min", "ms_max", "dq_err", "dk_err", "dv_err", "peak_mem_mib",
           # root-mean-square error of O against float64 (the FA3 paper's FP8 measure)
           "rmse",
           # the mask beyond `causal` (common/tile/masks.py): window_size "left,right", softcap, align
           "window", "softcap", "align",
           # the score terms (fa2, fa3): ALiBi's slopes (geometric, as its paper's) and sinks
           "alibi", "sinks",
           # dropout on P (fa2): its probability (the mask: common/tile/dropout.py, seeded by `seed`)
           "dropout"]
PASSES = ("fwd", "bwd", "fwd_bwd", "decode")
# pass=decode (experiments/decode.py): GB/s of K and V read, and their fraction of the run's copy
# bandwidth; the paged cache's page size
COLUMNS += ["gbs", "of_copy", "page_size"]
# score_mod / mask_mod (docs/score_mods.md): the dotted names, "n=name;..."
COLUMNS += ["mods"]

SIM_BANNER = ("No CUDA GPU here: the kernels run in Numba's CUDA simulator, on a small problem, and "
              "are checked against float64 exactly as on a GPU.\nThe times printed are the "
              "simulator's Python wall-clock: they mean nothing about kernel speed.")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    if cfg.dry_run:
        common.select_backend()
        return dry_run(cfg, "sim" if cfg.device == "sim" else "gpu")
    _pin_parallel_worker()
    mode = _select_backend(cfg.device)
    rows = run_job(cfg, mode)
    _write_rows(rows)
    # The job fails on its own kernel's errors; a peer's failed check is recorded, not raised.
    bad = [r for r in rows if r["status"].startswith("error") or
           (r["check"] == "FAIL" and r["variant"] == cfg.variant.name)]
    if bad and cfg.bench.fail_on_error:
        names = ", ".join(f"{r['variant']} ({r['status']}, check {r['check']})" for r in bad)
        raise RuntimeError(f"failed: {names}")
    return rows


def _pin_parallel_worker():
    """Under a launcher that runs jobs side by side in worker processes (hydra/launcher=gpus, or
    joblib itself), give this worker a GPU of its own before CUDA starts (experiments/gpus.py)."""
    try:
        hc = HydraConfig.get()
    except ValueError:
        return
    if hc.mode == RunMode.MULTIRUN and "joblib" in str(hc.launcher.get("_target_", "")).lower():
        gpu = gpus.pin_this_process(Path(hc.sweep.dir))
        if gpu is not None:
            print(f"worker {os.getpid()} runs on GPU {gpu}")


def _select_backend(device):
    if device not in ("auto", "gpu", "sim"):
        raise ValueError(f"device must be auto, gpu or sim, got {device!r}")
    if device != "auto" and "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if device == "sim" else "0"
    mode = common.select_backend()
    if device != "auto" and mode != device:
        raise RuntimeError(f"device={device} was asked for, but this process already runs on {mode}")
    if mode == "gpu":
        from common.hardware.target import gpu_available
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
    if cfg.dtype.name == FP8 and mode == "sim" and not cfg.sim.full_problem:
        p["head_dim"] = 128   # FP8 (fa3) takes head_dim 128 or 256; the small problem's is 64
    seqlen, head_dim = int(p["seqlen"]), int(p["head_dim"])
    batch = p.get("batch") or max(1, int(p["tokens"]) // seqlen)
    heads = p.get("heads") or max(1, int(p["hidden"]) // head_dim)
    return dict(batch=int(batch), seqlen=seqlen, heads=int(heads), head_dim=head_dim,
                causal=bool(p["causal"]), seqlen_k=int(p.get("seqlen_k") or seqlen),
                heads_kv=int(p.get("heads_kv") or heads), softmax_scale=p.get("softmax_scale"),
                outliers=float(p.get("outliers") or 0.0),
                window_size=tuple(p.get("window") or (-1, -1)),
                softcap=float(p.get("softcap") or 0.0), align=p.get("align") or "bottom_right",
                alibi=bool(p.get("alibi")), sinks=bool(p.get("sinks")),
                dropout=float(p.get("dropout") or 0.0),
                **{n: p.get(n) for n in MOD_KEYS if p.get(n)})


# score_mod / mask_mod by dotted name (docs/score_mods.md); aux: a function (rng, batch, heads,
# n_q, n_k) -> tuple of host arrays; block_mask: true for mask_mod's BlockMask (the same for every
# batch and head)
MOD_KEYS = ("score_mod", "mask_mod", "score_mod_grad", "aux", "block_mask")


def mods_of(prob, rng, library):
    """(the call's score_mod keywords, the reference's) for problem.score_mod, mask_mod,
    score_mod_grad (dotted names) and aux (a dotted factory); ({}, {}) for none."""
    if not any(prob.get(n) for n in MOD_KEYS):
        return {}, {}
    from common.host.mods import device_function_of
    from experiments.measure import inputs
    fns = {n: device_function_of(prob[n], n) for n in MOD_KEYS[:3] if prob.get(n)}
    host_aux = ()
    if prob.get("aux"):
        module, _, attr = prob["aux"].rpartition(".")
        import importlib
        host_aux = tuple(getattr(importlib.import_module(module), attr)(
            rng, prob["batch"], prob["heads"], prob["seqlen"], prob["seqlen_k"]))
    call = dict(fns, aux=tuple(inputs.to_device(x, library) for x in host_aux))
    if prob.get("block_mask"):   # the mask_mod's BlockMask (one for every batch and head)
        import variants
        call["block_mask"] = variants.block_mask(
            fns["mask_mod"], prob["seqlen"], prob["seqlen_k"], aux=call["aux"],
            like=inputs.to_device(np.zeros(1, np.float32), library))
    ref = {n: f for n, f in fns.items() if n != "score_mod_grad"}
    return call, dict(ref, aux=host_aux)


def score_terms(prob, rng):
    """The host arrays of a problem's score terms (problem.alibi, problem.sinks): ALiBi's slopes
    2^(-8 h / H) for heads h = 1..H (its paper's), sinks N(0, 1) a head; {} for none."""
    from experiments.measure import inputs
    terms = {}
    heads = prob["heads"]
    if prob.get("alibi"):
        terms["alibi_slopes"] = inputs.alibi_slopes(heads)
    if prob.get("sinks"):
        terms["sinks"] = rng.standard_normal(heads).astype(np.float32)
    return terms


def dropout_of(prob, seed, rows, heads=None):
    """(the call's dropout keywords, the reference's) for problem.dropout: Philox seeded by the
    job's seed, offset 0; the reference's mask at `rows` of every batch and head (rows None:
    every row of batch 0's first `heads` heads, the backward check's)."""
    p = prob.get("dropout") or 0.0
    if not p:
        return {}, {}
    from common.tile import dropout
    call = dict(dropout_p=p, dropout_seed=seed, dropout_offset=0)
    batches, head_ids = (None, None) if rows is not None else ([0], range(heads))
    z = dropout.keep_mask(seed, 0, p, prob["batch"], prob["heads"], prob["seqlen"],
                          prob["seqlen_k"], rows=rows, batches=batches, head_ids=head_ids)
    return call, dict(dropout_p=p, dropout_mask=z)


def mask_of(prob):
    """The call's mask keywords (common/tile/masks.py) when the problem sets more than `causal`."""
    mask = dict(window_size=prob["window_size"], softcap=prob["softcap"], align=prob["align"])
    return {} if mask == dict(window_size=(-1, -1), softcap=0.0, align="bottom_right") else mask


def sdpa_takes(prob):
    """SDPA's masks: is_causal is top-left; no window, no softcap."""
    mask = mask_of(prob)
    plain = not mask or mask == dict(window_size=(-1, -1), softcap=0.0, align="top_left")
    plain = plain and not prob.get("alibi") and not prob.get("sinks") and not prob.get("dropout")
    plain = plain and not any(prob.get(n) for n in MOD_KEYS)
    return plain and (not prob["causal"] or prob["seqlen"] == prob["seqlen_k"]
                      or mask.get("align") == "top_left")


def run_job(cfg, mode):
    import variants
    from common.hardware import target
    from common.tile import masks
    from experiments import peers
    from experiments.measure import checks, flops, inputs, reference

    prob = resolve_problem(cfg, mode)
    dtype = cfg.dtype.name
    pass_ = cfg.get("pass") or "fwd"
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {', '.join(PASSES)}, got {pass_!r}")
    if pass_ == "decode":
        return decode_job(cfg, mode, prob)
    backward = pass_ != "fwd"
    fp8_run = dtype == FP8   # fp16 inputs, quantised to e4m3 before the timed call
    if fp8_run and (cfg.variant.name != "fa3" or backward):
        raise ValueError(f"dtype=fp8 runs fa3's forward (the FP8 path), not variant="
                         f"{cfg.variant.name} pass={pass_}")
    seed = int(cfg.seed) if cfg.seed is not None else inputs.fresh_seed()
    rng = np.random.default_rng(seed)
    library = inputs.default_library() if cfg.library == "auto" else cfg.library
    if mode == "sim":
        print(SIM_BANNER)
    print(f"{target.describe()} | {prob} | {dtype} | pass {pass_} | inputs: {library} | seed {seed}")

    shape = dict(batch=prob["batch"], seqlen=prob["seqlen"], heads=prob["heads"],
                 head_dim=prob["head_dim"], dtype="float16" if fp8_run else dtype,
                 seqlen_k=prob["seqlen_k"], heads_kv=prob["heads_kv"])

    def draw():
        qkv = inputs.random_qkv(rng, **shape)
        if prob["outliers"]:
            qkv = tuple(inputs.add_outliers(rng, x, prob["outliers"]) for x in qkv)
        if backward:   # dO, like q
            qkv += (rng.standard_normal(qkv[0].shape, dtype=np.float32).astype(qkv[0].dtype),)
        return qkv

    host = draw()
    # Rotate input sets so that repeated timing runs do not all hit a warm L2 cache.
    set_bytes = sum(x.nbytes for x in host)
    n_sets = 1 if mode == "sim" else int(min(cfg.bench.max_input_sets,
                                             max(1, math.ceil(cfg.bench.rotate_bytes / set_bytes))))
    sets = [tuple(inputs.to_device(x, library) for x in host)]
    sets += [tuple(inputs.to_device(x, library) for x in draw()) for _ in range(n_sets - 1)]

    n_q = prob["seqlen"]
    check_rows = np.arange(n_q)
    if n_q > cfg.bench.check_rows:
        check_rows = np.unique(np.concatenate([[0, n_q - 1], rng.choice(n_q, cfg.bench.check_rows,
                                                                        replace=False)]))
    mask = mask_of(prob)
    host_terms = score_terms(prob, rng)
    terms = {name: inputs.to_device(x, library) for name, x in host_terms.items()}
    drop, ref_drop = dropout_of(prob, seed, check_rows)
    terms.update(drop)
    mods_call, mods_ref = mods_of(prob, rng, library)
    terms.update(mods_call)
    ref = reference.attention(*host[:3], causal=prob["causal"], softmax_scale=prob["softmax_scale"],
                              rows=check_rows, **mask, **host_terms, **ref_drop, **mods_ref)
    grad_ref = None
    if backward:   # batch 0, K/V head 0 and the query heads that share it
        group = prob["heads"] // prob["heads_kv"]
        q, k, v, do = host
        grad_ref = reference.attention_backward(q[:1, :, :group], k[:1, :, :1], v[:1, :, :1],
                                                do[:1, :, :group], causal=prob["causal"],
                                                softmax_scale=prob["softmax_scale"], **mask,
                                                **{n: x[:group] for n, x in host_terms.items()},
                                                **dropout_of(prob, seed, None, group)[1],
                                                **mods_ref)

    lse_tol = checks.fp8_lse_tolerance(host[0], host[1], prob["softmax_scale"]) if fp8_run \
        else checks.LSE_TOL
    pairs = None    # FLOPs: the FA papers' N^2 (halved when causal), or the mask's exact count
    if mask or (prob["causal"] and prob["seqlen"] != prob["seqlen_k"]):
        band = masks.band(prob["causal"], prob["window_size"], prob["align"], prob["seqlen"],
                          prob["seqlen_k"], 0.0, 1.0)
        pairs = flops.visible_pairs(prob["seqlen"], prob["seqlen_k"], band)
    ctx = dict(prob=prob, dtype=dtype, sets=sets, ref=ref, grad_ref=grad_ref, check_rows=check_rows,
               pairs=pairs,
               lse_tol=lse_tol,
               mode=mode, library=library, seed=seed, gpu=target.describe(), bench=cfg.bench,
               job=_job_name(), label=cfg.get("label") or "", pass_=pass_)
    options = _options(cfg.variant.get("options", {}))
    backward_options = _options(cfg.variant.get("backward_options", {}))
    module = variants.get(cfg.variant.name)
    if backward and not hasattr(module, "backward"):
        raise ValueError(f"pass={pass_}: variant {cfg.variant.name} has no backward pass")
    scale, causal = prob["softmax_scale"], prob["causal"]

    quantised = {id(s[0]): _quantise_fp8(s, cfg.fp8, prob["head_dim"]) for s in sets} \
        if fp8_run else {}

    def ours_forward(q, k, v, *_):
        if fp8_run:
            q, k, v, descales = quantised[id(q)]
            return module.forward(q, k, v, causal=causal, softmax_scale=scale, **descales,
                                  **mask, **terms, **options)   # (FP8 refuses the terms)
        return module.forward(q, k, v, causal=causal, softmax_scale=scale, **mask, **terms,
                              **options)

    def ours_backward(q, k, v, do, o, lse):
        return module.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, **mask,
                               **terms, **backward_options)

    shown = dict(options, **{f"bwd.{k}": v for k, v in backward_options.items()}) if backward \
        else options
    if fp8_run:
        shown = dict(shown, **{f"fp8.{k}": v for k, v in cfg.fp8.items()})
    rows = [measure(cfg.variant.name, pass_fn(pass_, ours_forward, ours_backward, sets), ctx,
                    options=shown, workspace=_workspace(module, prob, backward),
                    config_of=lambda ran: ran_config(module, ran))]
    if rows[0].get("config"):   # the forward's Config as the call resolved it (configs.recorded)
        print(f"{cfg.variant.name} configuration: {rows[0]['config']}")
    peer_jobs = cfg.bench.peer_variants
    if fp8_run and cfg.bench.peers:
        print("dtype=fp8: no SDPA peers (they would run in fp16; experiments/fp8.py speed times "
              "FP8 beside them)")
    elif cfg.bench.peers and not sdpa_takes(prob):
        print(f"mask {mask_of(prob)}{' with ' + ', '.join(terms) if terms else ''}: no SDPA "
              "peers (SDPA has no sliding window, softcap, ALiBi or sinks, no dropout mask to "
              "compare with, and its causal diagonal is top-left)")
    elif peers.available() and mode == "gpu" and library == "torch" and (
            peer_jobs is None or cfg.variant.name in peer_jobs):
        for name in cfg.bench.peers:
            fn = peers.forward_fn(name, causal, scale, gqa=prob["heads"] != prob["heads_kv"])
            rows.append(measure(name, peers.pass_fn(pass_, fn, sets), ctx))
    print_table(rows)
    return rows


FP8 = "float8_e4m3fn"


def decode_job(cfg, mode, prob):
    """pass=decode: one new token a sequence against caches of problem.seqlen_k tokens (paged,
    decode.page_size), through variants.decode with and without the split, fa2's forward and the
    SDPA peers (experiments/decode.py measures; each row is checked against float64 there)."""
    from experiments import decode as decode_experiment
    from experiments.measure import inputs

    if cfg.dtype.name != "bfloat16" or prob["causal"] or mask_of(prob):
        raise ValueError("pass=decode runs bf16 with no mask (one new token sees its whole cache)")
    torch = None
    if inputs.default_library() == "torch":
        import torch
    copy_gbs = decode_experiment.copy_bandwidth(torch) if torch is not None else float("nan")
    length, heads_kv = prob["seqlen_k"], prob["heads_kv"]
    if mode == "sim" and not cfg.sim.full_problem:   # the simulator's small problem: a short
        length = min(length, int(cfg.sim.problem.seqlen))   # cache, one K/V head
        heads_kv = 1
    found = decode_experiment.measure_size(
        prob["batch"], length, heads=prob["heads"], heads_kv=heads_kv,
        head_dim=prob["head_dim"], page_size=min(int(cfg.decode.page_size), length),
        peers_on=bool(cfg.bench.peers), copy_gbs=copy_gbs,
        pdls=(None if cfg.decode.pdl is None else bool(cfg.decode.pdl),),   # None: decode's default
        merges=(str(cfg.decode.merge_warps),))
    rows = [dict(variant=r["kernel"], dtype="bfloat16", head_dim=r["head_dim"], causal=False,
                 seqlen=1, batch=r["batch"], heads=r["heads"], gpu=r["gpu"], seqlen_k=length,
                 heads_kv=r["heads_kv"], check=r["check"], status="ok", mode=mode,
                 library=inputs.default_library(), label=cfg.label or "", job=_job_name(),
                 options="", config="", seed="", rmse="", window="", softcap="", align="",
                 **{"pass": "decode"}, ms=r["ms"], gbs=r["gbs"], of_copy=r["of_copy"],
                 page_size=r["page_size"]) for r in found]
    return rows


def _quantise_fp8(set_, fp8_cfg, head_dim):
    """(q8, k8, v8, forward's descale keywords) of one fp16 input set, as cfg.fp8 says."""
    from variants import fp8
    if fp8_cfg.scaling not in ("tensor", "block"):
        raise ValueError(f"fp8.scaling must be tensor or block, got {fp8_cfg.scaling!r}")
    block = int(fp8_cfg.block) if fp8_cfg.scaling == "block" else None
    signs = fp8.random_signs(head_dim, 0) if fp8_cfg.incoherent else None
    q, k, v = set_[:3]
    q8, qd = fp8.quantize_fp8(q, block=block, signs=signs)
    k8, kd = fp8.quantize_fp8(k, block=block, signs=signs)
    v8, vd = fp8.quantize_fp8(v, block=None, k_major=bool(fp8_cfg.get("v_k_major", False)))
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd, out_dtype="float16",
                            scale_block=block or fp8.DEFAULT_BLOCK)


def _options(node):
    """A variant config's options (or backward_options) that are set; a variant file without the
    key (or with it empty) has none."""
    if node is None:
        return {}
    items = OmegaConf.to_container(node) if OmegaConf.is_config(node) else dict(node)
    return {k: v for k, v in items.items() if v is not None}


def pass_fn(pass_, forward, backward, sets):
    """fn(i) running the timed pass on input set i, returning (o, lse, grads): fwd runs forward;
    bwd runs backward from a forward made once per set beforehand (lazily, outside the timing);
    fwd_bwd runs both."""
    from experiments.measure.timing import PerInputSet
    saved = PerInputSet(len(sets), lambda j: forward(*sets[j][:3]))

    def fn(i):
        q, k, v, *rest = sets[i % len(sets)]
        if pass_ == "fwd":
            o, lse = forward(q, k, v)
            return o, lse, None
        o, lse = saved[i] if pass_ == "bwd" else forward(q, k, v)
        return o, lse, backward(q, k, v, rest[0], o, lse)

    fn.prime = saved.prime   # bwd: every set's forward now, outside any timing
    return fn


def _workspace(module, prob, backward):
    shape = (prob["batch"], prob["heads"], prob["seqlen"], prob["seqlen_k"])
    total = 0
    for name in ("workspace_bytes", "backward_workspace_bytes") if backward else ("workspace_bytes",):
        fn = getattr(module, name, None)
        total = max(total, fn(*shape) if fn else 0)
    return total


def ran_config(module, ran):
    """The forward's configuration in a job's log and CSV (`config`): 'name=value;...' over the
    variant's OPTIONS of the first of its Configs among `ran`, the configurations the job's first
    calls resolved themselves (common/host/configs.py recorded); '' for a variant without options,
    or a call that failed before it resolved one."""
    config_class = getattr(module, "Config", None)
    chosen = next((c for c in ran if config_class is not None and isinstance(c, config_class)),
                  None)
    return "" if chosen is None else ";".join(f"{k}={getattr(chosen, k)}" for k in module.OPTIONS)


def call_config(module, prob, dtype, options, fp8_cfg, backward=False):
    """dry_run's resolution of the job's forward (backward=True: backward) the way its call
    resolves it, or None for a variant without options (standard): a dict of `config` (the
    Config), `names` (its options), `default_config`, `head_dims` (those it takes), `flags` (the
    problem fields with defaults of their own) and `chosen` (a choice the call makes before any
    Config: fa3's backward kernel, as (value, how)). The problem's fields as the call derives them
    from its inputs: the band of common/tile/masks.py (configs.mask_fields), fa3's FP8 fields as
    its forward reads them from the descales (K's by block when the block scaling gives it more
    than one), the element the call computes in (FP8 runs write fp16, _quantise_fp8).
    tests/test_config.py holds this to the Config a job's call resolved."""
    from types import SimpleNamespace

    from common.host import configs
    from common.tile import masks
    from variants import fa2_backward
    scale = prob["softmax_scale"] if prob["softmax_scale"] is not None \
        else 1.0 / math.sqrt(prob["head_dim"])
    band = masks.band(prob["causal"], prob["window_size"], prob["align"], prob["seqlen"],
                      prob["seqlen_k"], prob["softcap"], scale)
    fields = configs.mask_fields(SimpleNamespace(band=band, softcapped=band.softcap > 0,
                                                 varlen=None, alibi=prob.get("alibi") or None,
                                                 sinks=prob.get("sinks") or None,
                                                 dropout_p=prob.get("dropout") or 0.0),
                                 backward=backward)
    element = "float16" if dtype == FP8 else dtype
    head_dims, chosen, options = list(module.HEAD_DIMS), {}, dict(options)
    if not backward:
        default_config = getattr(module, "default_config", None)
        names, defaults = getattr(module, "OPTIONS", ()), getattr(module, "DEFAULTS", {})
        if dtype == FP8:   # fa3's FP8 forward: e4m3 inputs and their descales
            k_scales = fp8_cfg.scaling == "block" and \
                -(-prob["seqlen_k"] // int(fp8_cfg.block)) > 1
            fields = (("fp8", True), ("k_block_scales", k_scales)) + fields
    elif hasattr(module, "BACKWARD_KERNELS"):   # fa3: its own backward kernel, or FA2's
        from variants import fa3_backward
        kernel = options.pop("kernel", None)
        how = "set"
        if kernel is None:   # fa3.backward's own choice
            kernel = module.backward_kernel(prob["head_dim"], prob["softcap"], None,
                                            bool(prob.get("score_mod") or prob.get("mask_mod")))
            own = fa3_backward.HEAD_DIMS
            how = (f"null  (default: wgmma at d={own[0]}..{own[-1]} without softcap or "
                   f"score_mod / mask_mod; else fa2)")
        chosen["kernel"] = (kernel, how)
        target = fa3_backward if kernel == "wgmma" else fa2_backward
        default_config, names = target.default_backward_config, target.BACKWARD_OPTIONS
        defaults = target.BACKWARD_DEFAULTS
        head_dims = [d for d in head_dims if d in target.HEAD_DIMS]
    else:   # fa2's backward kernels (fa1: in Algorithm 4's schedule)
        default_config = getattr(module, "default_backward_config", None)
        names, defaults = getattr(module, "BACKWARD_OPTIONS", ()), fa2_backward.BACKWARD_DEFAULTS
    if default_config is None:
        return None
    config = default_config(prob["head_dim"], element, band.banded, fields, **options)
    return dict(config=config, names=tuple(names), default_config=default_config,
                head_dims=head_dims, flags=configs.default_flags(defaults), chosen=chosen)


def dry_run(cfg, mode):
    """dry_run=true: the job's problem and the Config its call resolves (call_config; the
    backward's too with pass=bwd or fwd_bwd), every field: the problem's, and each option's value
    and where it came from (null in the variant file: the code's default; or set), with its
    default over the head dims: the one statement of the defaults, made from the code. Nothing
    is drawn, compiled or run. The problem is the GPU's (device=sim: the simulator's small one)."""
    import variants
    from common.host import configs
    prob = resolve_problem(cfg, mode)
    pass_ = cfg.get("pass") or "fwd"
    module = variants.get(cfg.variant.name)
    print(f"{cfg.variant.name} | {prob} | {cfg.dtype.name} | pass {pass_}")
    passes = [("forward", False)] + ([("backward", True)] if pass_ in ("bwd", "fwd_bwd") else [])
    for name, backward in passes:
        options = _options(cfg.variant.get("backward_options" if backward else "options"))
        found = call_config(module, prob, cfg.dtype.name, options, cfg.fp8, backward=backward)
        if found is None:
            print(f"{name} configuration: " + ("(no options)" if not options else str(options)))
            continue
        config, names = found["config"], found["names"]
        print(f"{name} configuration: " + " ".join(
            [f"{k}={v}" for k, (v, _) in found["chosen"].items()] +
            [f"{k}={getattr(config, k)}" for k in names]))
        everywhere = configs.resolved_defaults(found["default_config"], found["head_dims"],
                                               found["flags"])
        lines = [(k, v, how) for k, (v, how) in found["chosen"].items()]
        for f in dataclasses.fields(config):
            if f.name in names:
                default = configs.describe_default(f.name, everywhere, found["head_dims"])
                how = ("set" if f.name in options else "null") + f"  (default: {default})"
            elif f.name in configs.PROBLEM_FIELDS:
                how = "the problem's"
            else:
                how = "fixed by the variant (not an option)"
            lines.append((f.name, configs.show_value(getattr(config, f.name)), how))
        print(f"  {type(config).__module__}.{type(config).__qualname__}, every field:")
        width = max(len(k) for k, _, _ in lines)
        value_width = max(len(str(v)) for _, v, _ in lines)
        for k, v, how in lines:
            print(f"    {k:<{width}}  {str(v):<{value_width}}  {how}")


def measure(name, fn, ctx, options=None, workspace=0, config_of=None):
    """Check fn on the first input set, then time it rotating over all sets: one CSV row.
    fn(i) -> (o, lse or None, (dq, dk, dv) or None), see pass_fn. config_of(ran): the row's
    `config` from the configurations the first calls (the check's, and pass=bwd's forwards)
    resolved (configs.recorded; not the timed calls, so that recording costs them nothing)."""
    from common.host import configs
    from experiments.measure import checks, flops, inputs, timing

    prob, bench, pass_ = ctx["prob"], ctx["bench"], ctx["pass_"]
    row = dict(variant=name, dtype=ctx["dtype"], head_dim=prob["head_dim"],
               causal=prob["causal"], seqlen=prob["seqlen"], batch=prob["batch"],
               heads=prob["heads"], gpu=ctx["gpu"], seqlen_k=prob["seqlen_k"],
               heads_kv=prob["heads_kv"], mode=ctx["mode"], library=ctx["library"],
               options=";".join(f"{k}={v}" for k, v in (options or {}).items()),
               label=ctx["label"], seed=ctx["seed"], job=ctx["job"], check="", status="ok",
               window="{},{}".format(*prob["window_size"]), softcap=prob["softcap"],
               align=prob["align"], alibi=prob.get("alibi", False), sinks=prob.get("sinks", False),
               dropout=prob.get("dropout", 0.0), **{"pass": pass_},
               mods=";".join(f"{n}={prob[n]}" for n in MOD_KEYS if prob.get(n)))
    free = _free_device_bytes(ctx)
    if workspace and free is not None and workspace > free:
        row["status"] = f"skipped: needs {workspace / 2**30:.1f} GiB of work memory"
        return row
    ran = []   # the configurations the first calls resolved (configs.recorded)
    try:
        with configs.recorded() as ran:
            if pass_ == "bwd":
                fn.prime()   # the forwards the backward starts from, outside memory and timing
            started = time.perf_counter()
            with _peak_memory(ctx["library"]) as peak:
                o, lse, grads = fn(0)
            first_ms = (time.perf_counter() - started) * 1e3
        if peak.mib is not None:
            row["peak_mem_mib"] = f"{peak.mib:.1f}"
        has_lse = lse is not None   # torch SDPA does not return the log-sum-exp
        rows_ = ctx["check_rows"]
        o_host = inputs.to_host(o)[:, rows_]
        lse_host = inputs.to_host(lse)[:, :, rows_] if has_lse else ctx["ref"][1]
        result = checks.compare(o_host, lse_host, *ctx["ref"], ctx["dtype"], ctx["lse_tol"])
        ok = result["ok"]
        if grads is not None:
            group = prob["heads"] // prob["heads_kv"]
            got = [inputs.to_host(g)[:1, :, :n] for g, n in zip(grads, (group, 1, 1))]
            errors = checks.compare_gradients(got, ctx["grad_ref"], ctx["dtype"])
            row.update({f"{g}_err": f"{errors[g]:.3e}" for g in ("dq", "dk", "dv")})
            ok = ok and errors["ok"]
        del o, lse, grads
        row.update(rel_err=f"{result['rel_err']:.3e}", max_err=f"{result['max_err']:.3e}",
                   rmse=f"{result['rmse']:.3e}",
                   lse_err=f"{result['lse_err']:.3e}" if has_lse else "",
                   check="ok" if ok else "FAIL")
        if ctx["mode"] == "sim":   # one simulated run is slow enough; its time means nothing
            t = timing.Timing(first_ms, first_ms, first_ms, 1, simulated=True)
        else:
            t = timing.benchmark(fn, warmup=bench.warmup, min_reps=bench.min_reps,
                                 max_reps=bench.max_reps, target_ms=bench.target_ms)
        total = flops.attention_flops(prob["batch"], prob["heads"], prob["seqlen"],
                                      prob["seqlen_k"], prob["head_dim"], prob["causal"], pass_,
                                      pairs=ctx["pairs"])
        tflops = "" if t.simulated else f"{total / t.median_ms / 1e9:.1f}"
        row.update(ms=f"{t.median_ms:.4f}", ms_min=f"{t.min_ms:.4f}", ms_max=f"{t.max_ms:.4f}",
                   reps=t.reps, tflops=tflops)
        if pass_ == "fwd":
            row.update(fwd_ms=row["ms"], fwd_ms_min=row["ms_min"], fwd_ms_max=row["ms_max"],
                       fwd_tflops=tflops)
    except Exception as exc:  # one kernel's failure must not hide the others' rows
        if _is_out_of_memory(exc):
            row["status"] = "oom"
        else:
            traceback.print_exc()
            row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        _release_memory(ctx["library"])
    if config_of is not None:
        row["config"] = config_of(ran)
    return row


class _peak_memory:
    """Peak device memory allocated inside the block beyond what was allocated before it, in MiB
    (torch's caching allocator sees every allocation of torch inputs' calls; None otherwise)."""

    def __init__(self, library):
        self.library, self.mib = library, None

    def __enter__(self):
        if self.library == "torch":
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.library == "torch" and exc[0] is None:
            import torch
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self.base) / 2**20
        return False


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
    cols = ["variant", "pass", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "ms",
            "tflops", "rel_err", "dq_err", "peak_mem_mib", "check", "status"]
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
        path.parent.mkdir(parents=True, exist_ok=True)
        # jobs of a parallel sweep append to the sweep's file at once: one at a time, the header
        # written by whichever comes first
        with path.open("a", newline="") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            if f.seek(0, os.SEEK_END) == 0:
                w.writeheader()
            w.writerows(rows)
            f.flush()
        print(f"rows written to {path}")


if __name__ == "__main__":
    main()
