"""PyTorch SDPA's flash backend on this codebase's kernels, through torch's flash-attention
registry (torch >= 2.11: `torch.nn.attention.register_flash_attention_impl`):

    from variants.integrations import sdpa
    sdpa.register()                                              # names it; overrides nothing
    torch.nn.attention.activate_flash_attention_impl(sdpa.NAME)  # the user opts in
    F.scaled_dot_product_attention(q, k, v, is_causal=True)      # flash backend -> fa3 / fa2

Activating it implements aten's `_scaled_dot_product_flash_attention` and its backward for CUDA
tensors: every call SDPA sends to its flash backend (its own choice, or
`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`) runs `variants.forward` / `variants.backward` with
the generation for the GPU (fa3 on sm_90, fa2 elsewhere), and the autograd formula torch already
has connects the two. q, k, v arrive as (B, H, N, d) and are handed over as (B, N, H, d) views
(no copy when they were made by transposing such tensors, as attention layers do); this aten
op's is_causal is the bottom-right diagonal (torch's CausalBias sends `causal_lower_right` to it
so; SDPA's own is_causal reaches it only for square problems, where the two agree); head dims
that are not a multiple of 8 are padded as flash_attn does. The output has the strides torch's
meta function gives it (those of `empty_like(query)`). What the kernels do not take (dropout, a
debug mask, other dtypes) goes to the kernel that was there before (`torch.library.get_kernel`),
or, where this torch has no way to reach it, raises naming the argument. Nothing happens on
import: registering is opt-in and activating is the user's (torch asks providers never to
activate themselves).
"""
NAME = "flash_numba"
FORWARD = "_scaled_dot_product_flash_attention"
BACKWARD = "_scaled_dot_product_flash_attention_backward"


def register():
    """Name this implementation in torch's registry (idempotent). Needs torch >= 2.11."""
    import torch.nn.attention as attention
    if not hasattr(attention, "register_flash_attention_impl"):
        import torch
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention registry "
                           "(torch.nn.attention.register_flash_attention_impl, torch >= 2.11)")
    attention.register_flash_attention_impl(NAME, register_fn=install)


def activate():
    """register() and torch.nn.attention.activate_flash_attention_impl(NAME) in one call."""
    import torch.nn.attention as attention
    register()
    attention.activate_flash_attention_impl(NAME)


class Handle:
    """What torch's registry keeps while the implementation is active; remove() restores the
    kernels that were there before."""

    def __init__(self, library):
        self.library = library

    def remove(self):
        if self.library is not None:
            self.library._destroy()
            self.library = None


def install():
    """The register_fn torch's registry calls on activation: aten's two flash kernels for CUDA
    replaced by this module's. Returns the Handle that undoes it."""
    import torch
    library = torch.library.Library("aten", "IMPL")   # noqa: TOR901 (aten on purpose)
    get_kernel = getattr(torch.library, "get_kernel", None)
    for op, impl in ((FORWARD, _forward), (BACKWARD, _backward)):
        before = get_kernel(f"aten::{op}", "CUDA") if get_kernel is not None else None
        library.impl(op, _with_fallback(impl, before, op), "CUDA", with_keyset=True)
    return Handle(library)


def _with_fallback(impl, before, op):
    def kernel(keyset, *args, **kwargs):
        why = impl(None, *args, **kwargs)   # None: only say whether it is taken, and why not
        if why is None:
            return impl(True, *args, **kwargs)
        if before is None:
            raise NotImplementedError(f"{NAME} (SDPA's flash backend): {why}; this torch offers "
                                      "no way back to the kernel it replaced")
        return before.call_boxed(keyset, *args, **kwargs)
    kernel.__name__ = f"{NAME}_{op}"
    return kernel


def _unsupported(query, key, value, dropout_p, *, debug_mask=False):
    """Why the kernels cannot take this call, or None."""
    import torch
    if dropout_p:
        return f"dropout_p={dropout_p}"
    if debug_mask:
        return "return_debug_mask=True"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "q, k and v must be 4-D (B, H, N, d)"
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return "a V head dim other than Q and K's"
    if query.shape[-1] > 256:
        return f"head_dim {query.shape[-1]} > 256"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads on {key.shape[1]} K/V heads"
    return None


def _bnhd(x):
    """(B, H, N, d) -> a (B, N, H, d) view, contiguous along d."""
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(run, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
             scale=None):
    why = _unsupported(query, key, value, dropout_p, debug_mask=return_debug_mask)
    if run is None or why is not None:
        return why
    import torch

    from variants import flash_attn, registry
    q, k, v, d, _ = flash_attn._pad_head_dims(_bnhd(query), _bnhd(key), _bnhd(value))
    scale = d ** -0.5 if scale is None else scale
    o, lse = registry.forward(q, k, v, variant=flash_attn.default_variant(query),
                              causal=is_causal, softmax_scale=scale)
    out = _strided_like(o[..., :d].transpose(1, 2), query)
    seed = torch.zeros(2, dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    return (out, lse, None, None, query.shape[2], key.shape[2], seed, offset,
            torch.empty(0, dtype=query.dtype, device=query.device))


def _backward(run, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
              max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    why = _unsupported(query, key, value, dropout_p)
    if run is None or why is not None:
        return why
    from variants import flash_attn, registry
    d = query.shape[-1]
    q, k, v, _, _ = flash_attn._pad_head_dims(_bnhd(query), _bnhd(key), _bnhd(value))
    o, do, _, _, _ = flash_attn._pad_head_dims(_bnhd(out), _bnhd(grad_out), _bnhd(out))
    scale = d ** -0.5 if scale is None else scale
    dq, dk, dv = registry.backward(do.contiguous(), q, k, v, o, logsumexp,
                                   variant=flash_attn.default_variant(query), causal=is_causal,
                                   softmax_scale=scale)
    return tuple(_strided_like(g[..., :d].transpose(1, 2), x)
                 for g, x in ((dq, query), (dk, key), (dv, value)))


def _strided_like(x, like):
    """x with the strides of torch.empty_like(like), which torch's meta functions give these
    operators' outputs (a copy only when they differ: a (B, H, N, d)-contiguous input)."""
    if x.stride() == like.stride():   # (no allocation on the usual path: transposed views)
        return x
    import torch
    want = torch.empty_like(like)
    return x if x.stride() == want.stride() else want.copy_(x)
