"""One call of every variant's forward and backward, at a ragged length, with and without masks, and
of fa2's packed (varlen) batch: a target for compute-sanitizer, so that one run covers every kernel
the library launches by default:

    compute-sanitizer --tool memcheck --report-api-errors no python3 experiments/every_kernel.py
    compute-sanitizer --tool racecheck --racecheck-report hazard python3 experiments/every_kernel.py

(`--report-api-errors no`: plain memcheck reports the driver bindings' host-side cuGetProcAddress
misses, which hide real errors.) Each call's output is checked against float64 too, so a run that
the sanitizer passes also computed the right thing. `[seqlen]` defaults to 130 (one full and one
ragged block of most tiles); in the simulator (NUMBA_ENABLE_CUDASIM=1) pass a small one.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

MODE = common.select_backend()

import numpy as np  # noqa: E402

import variants  # noqa: E402
from experiments.measure import checks, inputs, reference  # noqa: E402

MASKS = [dict(), dict(causal=True), dict(causal=True, window_size=(48, 0), softcap=20.0)]


def check(name, o, lse, ref, dtype):
    o, lse = (x if isinstance(x, np.ndarray) else inputs.to_host(x) for x in (o, lse))
    got = checks.compare(o, lse, *ref, dtype)
    if not got["ok"]:
        raise AssertionError(f"{name}: " + checks.describe_failure(got))
    print("ok", name, flush=True)


def main(seqlen=130):
    rng = np.random.default_rng(2)
    library = inputs.default_library()
    dtype, head_dim = "bfloat16", 64 if MODE == "sim" else 128
    host = inputs.random_qkv(rng, 1, seqlen, 2, head_dim, dtype, heads_kv=1)
    do_host = rng.standard_normal(host[0].shape, dtype=np.float32).astype(host[0].dtype)
    q, k, v, do = (inputs.to_device(x, library) for x in host + (do_host,))
    for variant in variants.REGISTRY:
        module = variants.get(variant)
        for mask in MASKS:
            if variant == "fa3" and (MODE == "sim" or set(mask) - {"causal"}):
                continue   # fa3: the GPU's; causal only (README: limits)
            o, lse = variants.forward(q, k, v, variant=variant, **mask)
            check(f"{variant} forward {mask}", o, lse, reference.attention(*host, **mask), dtype)
            if hasattr(module, "backward"):
                grads = variants.backward(do, q, k, v, o, lse, variant=variant, **mask)
                errors = checks.compare_gradients([inputs.to_host(g) for g in grads],
                                                  reference.attention_backward(*host, do_host,
                                                                               **mask), dtype)
                assert errors["ok"], f"{variant} backward {mask}: {errors}"
                print("ok", variant, "backward", mask, flush=True)
    # fa2's packed batch: three sequences of the same rows, one of them empty of queries
    lengths = [seqlen // 3, 0, seqlen - seqlen // 3]
    cu = inputs.to_device(np.array([0, lengths[0], lengths[0], seqlen], np.int32), library)
    packed = [inputs.to_device(x[0], library) for x in host + (do_host,)]
    for mask in MASKS[1:]:
        o, lse = variants.forward_varlen(*packed[:3], cu, cu, max(lengths), max(lengths), **mask)
        variants.backward_varlen(packed[3], *packed[:3], o, lse, cu, cu, max(lengths),
                                 max(lengths), **mask)
        first = slice(0, lengths[0])
        ref = reference.attention(*(x[:, first] for x in host), **mask)
        check(f"fa2 varlen forward {mask} (first sequence)", inputs.to_host(o)[None, first],
              inputs.to_host(lse)[None, :, first], ref, dtype)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
