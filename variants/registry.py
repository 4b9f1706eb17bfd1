"""The one registry of attention variants and the calls that dispatch on it: `forward`,
`backward` and their packed-batch forms look a variant's module up by name and call it.
Everything above the variants (autograd, the torch operators, context parallelism, the
integrations) calls these, so that no module imports the package face that imports it."""
from importlib import import_module

REGISTRY = {
    "standard": "variants.standard",   # S and P materialised in HBM: the O(N^2) baseline
    "fa1": "variants.fa1",             # FlashAttention-1, Algorithm 1, and the ladder's rungs to FA2
    "fa2": "variants.fa2",             # FlashAttention-2, Algorithm 1
    "fa3": "variants.fa3",             # FlashAttention-3 (Hopper): wgmma, TMA, warp specialisation
}


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
    return get(variant).forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **options)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   variant="fa2", causal=False, softmax_scale=None, **options):
    """Attention forward over a packed batch of sequences, as flash_attn_varlen_func: q (total_q,
    heads, d), k and v (total_k, heads_kv, d), cu_seqlens_q/k int32 device arrays (batch + 1) of
    the sequences' first rows; returns o (total_q, heads, d) and lse (heads, total_q) float32. The
    mask keywords are forward's, applied within each sequence."""
    module = get(variant)
    if not hasattr(module, "forward_varlen"):
        raise ValueError(f"variant {variant!r} has no variable-length forward; these do: "
                         f"{', '.join(n for n in REGISTRY if hasattr(get(n), 'forward_varlen'))}")
    return module.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal=causal, softmax_scale=softmax_scale, **options)


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    *, variant="fa2", causal=False, softmax_scale=None, **options):
    """The backward of forward_varlen: (dq, dk, dv) like (q, k, v) of the packed batch."""
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
    module = get(variant)
    if not hasattr(module, "backward"):
        raise ValueError(f"variant {variant!r} has no backward pass; these do: "
                         f"{', '.join(n for n in REGISTRY if hasattr(get(n), 'backward'))}")
    return module.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                           **options)
