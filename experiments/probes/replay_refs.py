"""Which of a call's tensors outlive it with the collector off (common/host/replay.py: the first call of
a geometry takes the checked path, the second is recorded, the third replayed).

    python experiments/probes/replay_refs.py        (GPU host, torch)

For fa2 and fa3, forward alone and backward alone, after 1, 2 and 3 calls of one geometry with the
collector off: the tensors still alive (q, k, v, o, lse, dq, dk, dv), and for the first one alive
what refers to it (four levels of gc.get_referrers). A reference cycle shows as a tensor alive
after every later call too; something released later shows as alive after call 2 only.

2026-11-27, H200 (docs/results/replay_refs_h200_20261127.txt): alive after the first recorded
call of the process only (fa2 forward, 2 calls: q, k, v, o, lse); every other case freed at once.
(Each case starts with a collection, which freed them.) The cause, found on the CPU with torch
2.13 and a fake launcher: the first dispatch mode of a process imports torch._dynamo, and the
import leaves reference cycles through frames whose callers hold the call's tensors. Since then
common/host/replay.py uses its mode once on a thread of its own first (_first_use_apart).
"""
import gc
import sys
import types
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402

common.select_backend()


def describe(o):
    if isinstance(o, dict):
        return "dict keys=" + ",".join(map(str, list(o)[:8]))
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} {o.f_code.co_filename}:{o.f_lineno}"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__} len={len(o)} " + ",".join(type(x).__name__ for x in o[:8])
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__}"
    return type(o).__module__ + "." + type(o).__qualname__


def referrers(x, depth, seen, pad=""):
    here = sys._getframe()
    for r in gc.get_referrers(x):
        if id(r) in seen or r is here or isinstance(r, types.FrameType) \
                and r.f_code.co_name in ("referrers", "main"):
            continue
        seen.add(id(r))
        print(pad + describe(r))
        if depth > 1:
            referrers(r, depth - 1, seen, pad + "  ")


def main():
    import numpy as np
    import torch

    import variants
    from common.host import problem, replay
    from experiments.measure import inputs
    from variants import backward_shared as backward
    rng = np.random.default_rng(0)
    names = ["q", "k", "v", "o", "lse", "dq", "dk", "dv"]
    for variant in ("fa2", "fa3"):
        m = variants.get(variant)
        for what in ("forward", "backward"):
            for calls in (1, 2, 3):
                problem._TEMPLATES.clear()
                backward._TEMPLATES.clear()
                replay.forget()
                q, k, v = (inputs.to_device(x, "torch")
                           for x in inputs.random_qkv(rng, 2, 200, 4, 64, "bfloat16"))
                do = torch.randn_like(q)
                if what == "backward":
                    o, lse = m.forward.__wrapped__(q, k, v)
                grads = ()
                gc.collect()
                gc.disable()
                for _ in range(calls):
                    if what == "forward":
                        o, lse = m.forward(q, k, v)
                    else:
                        grads = m.backward(do, q, k, v, o, lse)
                refs = [weakref.ref(x) for x in (q, k, v, o, lse, *grads)]
                del q, k, v, o, lse, grads, do
                alive = [n for n, r in zip(names, refs) if r() is not None]
                print(f"== {variant} {what}, {calls} calls: alive {alive}")
                if alive:
                    referrers(refs[names.index(alive[0])](), 4, {id(refs)})
                gc.enable()


if __name__ == "__main__":
    main()
