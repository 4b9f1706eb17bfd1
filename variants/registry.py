"""The one registry of attention variants and the calls that dispatch on it: `forward`,
`backward` and their packed-batch forms look a variant's module up by name and call it. A problem
with nothing to compute (a batch of no sequence, no query, or no key: flash_attn's empty cases)
launches nothing: the forward returns O = 0 and the backward zero gradients, as flash_attn does,
and LSE = -inf, this codebase's value for a row that sees no key (flash_attn fills +inf there).
Everything above the variants (autograd, the torch operators, context parallelism, the
integrations) calls these, so that no module imports the package face that imports it."""
from importlib import import_module

REGISTRY = {
    "standard": "variants.standard",   # S and P materialised in HBM: the O(N^2) baseline
    "fa1": "variants.fa1",             # FlashAttention-1, Algorithm 1, and the ladder's rungs to FA2
    "fa2": "variants.fa2",             # FlashAttention-2, Algorithm 1
    "fa3": "variants.fa3",             # FlashAttention-3 (Hopper): wgmma, TMA, warp specialisation
}


# The variants whose kernels take score_mod / mask_mod (common/host/mods.py, docs/score_mods.md)
MOD_VARIANTS = ("fa2", "fa3")   # (fa3: the forward; its backward runs fa2's kernels)
_MOD_KEYWORDS = ("score_mod", "mask_mod", "score_mod_grad", "aux")


def _check_mods(variant, options):
    """Refuse score_mod and friends, by name, for a variant that does not compile them in."""
    if variant not in MOD_VARIANTS:
        given = [n for n in _MOD_KEYWORDS if options.get(n) is not None]
        if given:
            raise ValueError(f"variant {variant!r} takes no {', '.join(given)}; score_mod and "
                             f"mask_mod are compiled into {', '.join(MOD_VARIANTS)} "
                             f"(docs/score_mods.md)")


def get(name):
    """The module of variant `name` (it has forward(q, k, v, *, causal, softmax_scale, **options))."""
    module = _MODULES.get(name)
    if module is None:
        if name not in REGISTRY:
            raise ValueError(f"unknown variant {name!r}; registered: {', '.join(REGISTRY)}")
        module = _MODULES[name] = import_module(REGISTRY[name])
    return module


_MODULES = {}


def forward(q, k, v, *, variant="fa2", causal=False, softmax_scale=None, **options):
    """Attention forward with the named variant; options are that variant's tuning knobs."""
    _check_mods(variant, options)
    if _empty(q, k, v, 4):
        return _empty_forward(q, k, options.get("out"), (q.shape[0], q.shape[2], q.shape[1]),
                              options.get("sinks"), heads_axis=1)
    return get(variant).forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)


_EMPTY_DTYPES = ("float16", "bfloat16")


def _empty(q, k, v, ndim):
    """True for a well-formed 16-bit problem with nothing to compute (some axis of length 0);
    anything else (FP8 and its KMajorV, a malformed call) goes on to the variant, whose checks
    name the problem (an empty one: "empty problem")."""
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (q, k, v)):
        return False
    shapes = [tuple(x.shape) for x in (q, k, v)]
    if any(len(s) != ndim for s in shapes) or shapes[1] != shapes[2] or \
            shapes[0][-1] != shapes[1][-1] or shapes[0][:-3] != shapes[1][:-3]:
        return False
    if not 0 in shapes[0] + shapes[1]:
        return False
    if any(str(x.dtype).removeprefix("torch.") not in _EMPTY_DTYPES for x in (q, k, v)) or \
            len({str(x.dtype) for x in (q, k, v)}) != 1:
        return False
    heads, heads_kv, head_dim = shapes[0][-2], shapes[1][-2], shapes[0][-1]
    return heads_kv > 0 and heads % heads_kv == 0 and 0 < head_dim <= 256


def _empty_forward(q, k, out, lse_shape, sinks=None, heads_axis=1):
    """(o, lse) of an empty problem: O = 0, LSE = -inf (no row sees a key), or with attention
    sinks each head's sink (the one logit its rows see)."""
    import numpy as np

    from common.host import arrays
    d = arrays.describe(q, "q")
    if out is None:
        out = (arrays.empty(d.library, tuple(q.shape), d.dtype, like=q),
               arrays.empty(d.library, lse_shape, "float32", like=q))
    o, lse = out
    arrays.fill(o, 0.0)
    if sinks is not None:
        _check_sinks(sinks, d, lse_shape[heads_axis])
    if sinks is None or 0 in lse_shape:
        return o, arrays.fill(lse, float("-inf"))
    shape = [-1 if a == heads_axis else 1 for a in range(len(lse_shape))]
    if d.library == "torch":   # on the device (no host round trip: CUDA-graph capture allows it)
        lse.copy_(sinks.view(shape).expand(lse_shape))
        return o, lse
    per_head = np.asarray(arrays.to_host(sinks), np.float32).reshape(shape)
    return o, arrays.copy_from_host(lse, np.broadcast_to(per_head, lse_shape))


def _check_sinks(sinks, q, heads):
    """The rules of problem.with_score_terms for sinks, on a call that launches nothing."""
    from common.host import arrays
    s = arrays.describe(sinks, "sinks")
    if s.library != q.library:
        raise TypeError(f"sinks is a {s.library} array but q is {q.library}")
    if s.dtype != "float32" or tuple(s.shape) != (heads,) or s.strides != (4,):
        raise ValueError(f"sinks must be a contiguous float32 array of shape ({heads},), got "
                         f"{s.dtype} of shape {s.shape}")


def _empty_backward(q, k, v, grads, sinks=None):
    """Zero gradients like q, k, v (or into `grads`); with sinks, a zero d sinks too (no row has
    an output for the sink's share to move)."""
    from common.host import arrays
    if grads is None:
        d = arrays.describe(q, "q")
        grads = tuple(arrays.empty(d.library, tuple(x.shape), d.dtype, like=q) for x in (q, k, v))
    grads = tuple(arrays.fill(g, 0.0) for g in grads)
    if sinks is not None:
        d = arrays.describe(sinks, "sinks")
        _check_sinks(sinks, arrays.describe(q, "q"), tuple(q.shape)[-2])
        grads += (arrays.fill(arrays.empty(d.library, tuple(d.shape), "float32", like=q), 0.0),)
    return grads


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   variant="fa2", causal=False, softmax_scale=None, **options):
    """Attention forward over a packed batch of sequences, as flash_attn_varlen_func: q (total_q,
    heads, d), k and v (total_k, heads_kv, d), cu_seqlens_q/k int32 device arrays (batch + 1) of
    the sequences' first rows; returns o (total_q, heads, d) and lse (heads, total_q) float32. The
    mask keywords are forward's, applied within each sequence."""
    _check_mods(variant, options)
    if _empty(q, k, v, 3):
        return _empty_forward(q, k, options.get("out"), (q.shape[1], q.shape[0]),
                              options.get("sinks"), heads_axis=0)
    module = get(variant)
    if not hasattr(module, "forward_varlen"):
        raise ValueError(f"variant {variant!r} has no variable-length forward; these do: "
                         f"{', '.join(n for n in REGISTRY if hasattr(get(n), 'forward_varlen'))}")
    return module.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal=causal, softmax_scale=softmax_scale, **options)


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    *, variant="fa2", causal=False, softmax_scale=None, **options):
    """The backward of forward_varlen: (dq, dk, dv) like (q, k, v) of the packed batch."""
    _check_mods(variant, options)
    if _empty(q, k, v, 3):
        return _empty_backward(q, k, v, options.get("grads"), options.get("sinks"))
    module = get(variant)
    if not hasattr(module, "backward_varlen"):
        raise ValueError(f"variant {variant!r} has no variable-length backward; these do: "
                         f"{', '.join(n for n in REGISTRY if hasattr(get(n), 'backward_varlen'))}")
    return module.backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                  **options)


def backward(do, q, k, v, o, lse, *, variant="fa2", causal=False, softmax_scale=None, **options):
    """Attention backward with the named variant: (dq, dk, dv) like (q, k, v), from the forward's
    inputs and outputs (o, lse) and dO (like o). options: the variant's backward knobs."""
    _check_mods(variant, options)
    if _empty(q, k, v, 4):
        return _empty_backward(q, k, v, options.get("grads"), options.get("sinks"))
    module = get(variant)
    if not hasattr(module, "backward"):
        raise ValueError(f"variant {variant!r} has no backward pass; these do: "
                         f"{', '.join(n for n in REGISTRY if hasattr(get(n), 'backward'))}")
    return module.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                           **options)
