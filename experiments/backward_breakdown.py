"""Where a fa2 backward call's time goes, beside SDPA's backward, on the FA2 paper's shapes (bf16,
batch * seqlen = 16k, hidden 2048): the whole call (`variants.backward`) with each dQ path
(`bulk`: atomic, added by bulk reductions, the default; `red`: atomic, by vector atomics from
registers; `separate`: a second kernel; each with the head_dim's default warp tiles, or as
`<path>_1d` / `<path>_2d` with one-row-a-warp or FA2's 2-D warp tiles; `<path>+<option>=<int>`
adds an option of `BackwardConfig`), and each of its parts timed alone on the same tensors
(argument checks and allocation `prep`, the D pre-pass `pre`, the K/V kernel `kv`, dQ's cast
`convert` or the separate dQ kernel `dqk`), then
SDPA flash's and cuDNN's backward through torch.autograd.grad on a kept graph. One line a problem:

    python experiments/backward_breakdown.py <head_dim>:<seqlen>:<causal 0|1> [...]
    python experiments/backward_breakdown.py 128:8192:0 64:8192:0
    python experiments/backward_breakdown.py --paths bulk,red 128:8192:0
    python experiments/backward_breakdown.py --paths bulk,bulk+dq_query_warps=2 128:8192:0

Milliseconds (median, CUDA events after warm-up), then TFLOP/s by the papers' count (backward 2.5x
the forward's FLOPs). Needs a GPU and torch.
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

common.select_backend()

import numpy as np  # noqa: E402

import variants  # noqa: E402
from common.host import arrays
from common.host.launching import launch  # noqa: E402
from common.host.mods import no_block_mask  # noqa: E402
from experiments.measure import flops, timing  # noqa: E402
from variants import backward_shared as bwd  # noqa: E402
from variants import fa2_backward  # noqa: E402


def median_ms(fn):
    return timing.benchmark(lambda i: fn(), warmup=3, min_reps=10, max_reps=40,
                            target_ms=150).median_ms


PATHS = {"bulk": dict(dq="atomic", dq_reduce="bulk"), "red": dict(dq="atomic", dq_reduce="red"),
         "separate": dict(dq="separate")}
# Each with 1-D and with FA2's 2-D warp tiles (query_warps=2: P^T and dS^T through shared memory;
# two m16 tiles of keys a warp, so K_j, V_j are streamed from shared memory, not held).
PATHS = dict({f"{name}_1d": dict(options, query_warps=1) for name, options in PATHS.items()},
             **{f"{name}_2d": dict(options, query_warps=2, kv_in_registers=False)
                for name, options in PATHS.items()}, **PATHS)


def path_options(path):
    """The backward options of a path: a PATHS name, then any `+option=<int>` overrides."""
    name, *overrides = path.split("+")
    options = dict(PATHS[name])
    for item in overrides:
        key, value = item.split("=")
        options[key] = int(value)
    return options


def parts(do, q, k, v, o, lse, causal, path):
    """{part: ms} of one dQ path's call, each part launched alone on prepared arguments."""
    options = path_options(path)
    head_dim = q.shape[-1]
    prepare = lambda: bwd.prepare_backward(do, q, k, v, o, lse, causal=causal,  # noqa: E731
                                           softmax_scale=None, head_dims=fa2_backward.HEAD_DIMS,
                                           variant="fa2")
    g = prepare()
    cfg = fa2_backward.default_backward_config(head_dim, "bfloat16", causal, **options)
    atomic = cfg.dq == "atomic"
    out = {f"call_{path}": median_ms(lambda: variants.backward(do, q, k, v, o, lse, causal=causal,
                                                               **options)),
           f"prep_{path}": median_ms(prepare),
           f"pre_{path}": median_ms(lambda: bwd.preprocess(g, zero_dq=atomic,
                                                           dq_layout=cfg.dq_layout()))}
    prob = g.prob
    scales = (np.float32(prob.softmax_scale), np.float32(prob.softmax_scale * math.log2(math.e)))
    sizes = (np.int32(prob.n_q), np.int32(prob.n_k), np.int32(prob.kv_group), *prob.mask_args())
    cu = (arrays.placeholder(prob.library, 1, prob.like, "int32"),) * 2   # no packed batch
    grid = ((prob.n_k + cfg.block_n - 1) // cfg.block_n, prob.batch, prob.heads_kv)
    out[f"kv_{path}"] = median_ms(lambda: launch(
        fa2_backward.build_backward(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream, prob.q, prob.k,
        prob.v, g.do, prob.lse, g.d_vec, g.dq_acc, g.dk32, g.dv32, *sizes, *scales, *cu,
        *prob.score_args(), *prob.dropout_args(), prob.aux, *no_block_mask(prob)))
    if atomic:
        out[f"convert_{path}"] = median_ms(lambda: bwd.convert_dq(g))
    else:
        grid = ((prob.n_q + cfg.dq_block_m - 1) // cfg.dq_block_m, prob.batch, prob.heads)
        out["dqk"] = median_ms(lambda: launch(
            fa2_backward.build_backward_dq(cfg), grid, 32 * cfg.dq_warps, cfg.dq_smem_bytes(), prob.stream,
            prob.q, prob.k, prob.v, g.do, prob.lse, g.d_vec, g.dq32, *sizes, *scales, *cu,
            *prob.score_args(), *prob.dropout_args(), prob.aux, *no_block_mask(prob)))
    return out


def main(specs, paths=tuple(PATHS)):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    for spec in specs:
        head_dim, seqlen, causal = (int(x) for x in spec.split(":"))
        causal = bool(causal)
        batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(batch, seqlen, heads, head_dim, device="cuda",
                                   dtype=torch.bfloat16, generator=gen) for _ in range(4))
        o, lse = variants.forward(q, k, v, causal=causal)
        res = {}
        for path in paths:
            try:
                fa2_backward.default_backward_config(head_dim, "bfloat16", causal, **path_options(path))
            except ValueError as e:     # e.g. a dQ split this tile cannot take
                print(f"d={head_dim}: no path {path}: {e}", flush=True)
                continue
            res.update(parts(do, q, k, v, o, lse, causal, path))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        for backend, name in ((SDPBackend.FLASH_ATTENTION, "flash"),
                              (SDPBackend.CUDNN_ATTENTION, "cudnn")):
            with sdpa_kernel(backend):
                out = sdpa(*(x.transpose(1, 2) for x in leaves), is_causal=causal)
            res[f"sdpa_{name}_bwd"] = median_ms(lambda: torch.autograd.grad(
                out, leaves, do.transpose(1, 2), retain_graph=True))
        work = flops.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "bwd")
        print(f"d={head_dim} n={seqlen} causal={causal} | "
              + " ".join(f"{key}={ms:.3f}" for key, ms in res.items()) + " | TFLOP/s: "
              + " ".join(f"{key}={work / ms / 1e9:.0f}" for key, ms in res.items()
                         if key.startswith(("call", "kv", "sdpa"))), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    paths = tuple(PATHS)
    if args[:1] == ["--paths"]:
        paths, args = tuple(args[1].split(",")), args[2:]
    main(args or ["128:8192:0", "64:8192:0"], paths)
