"""The variants as a torch.autograd.Function: a drop-in attention for a model.

    import variants
    o = variants.attention(q, k, v, variant="fa2", causal=True)   # q, k, v: torch CUDA tensors
    o.float().pow(2).sum().backward()                            # q.grad, k.grad, v.grad

q: (batch, seqlen_q, heads, head_dim), k and v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
bf16, as in flash_attn_func. The forward saves q, k, v, O and L = LSE (nothing N x N); the backward
runs the same variant's backward pass, which recomputes P from them. `forward_options` and
`backward_options` are the variant's knobs (e.g. backward_options={"dq": "separate"}).
torch is imported only when this is called.
"""
from functools import lru_cache


@lru_cache(maxsize=None)
def _function_class():
    import torch

    import variants

    class FlashAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, variant, causal, softmax_scale, mask, forward_options,
                    backward_options):
            o, lse = variants.get(variant).forward(q, k, v, causal=causal,
                                                   softmax_scale=softmax_scale, **dict(mask),
                                                   **dict(forward_options))
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.settings = (variant, causal, softmax_scale, dict(mask, **dict(backward_options)))
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            variant, causal, softmax_scale, options = ctx.settings
            dq, dk, dv = variants.backward(do.contiguous(), q, k, v, o, lse, variant=variant,
                                           causal=causal, softmax_scale=softmax_scale, **options)
            return dq, dk, dv, None, None, None, None, None, None

    return FlashAttentionFunction


def attention(q, k, v, *, variant="fa2", causal=False, softmax_scale=None, window_size=(-1, -1),
              softcap=0.0, align="bottom_right", forward_options=None, backward_options=None):
    """O = softmax(softmax_scale Q K^T) V with the named variant, differentiable in q, k, v; the
    mask (causal, window_size, softcap, align) as flash_attn_func's (common/masks.py)."""
    if type(q).__module__.split(".")[0] != "torch":
        raise TypeError(f"attention() is the torch autograd wrapper; q is a {type(q).__name__}. "
                        "For CuPy or Numba arrays call variants.forward / variants.backward")
    mask = ()
    if softcap or align != "bottom_right" or tuple(window_size) != (-1, -1):
        mask = (("window_size", tuple(window_size)), ("softcap", softcap), ("align", align))
    return _function_class().apply(q, k, v, variant, causal, softmax_scale, mask,
                                   tuple(sorted(forward_options.items())) if forward_options else (),
                                   tuple(sorted(backward_options.items())) if backward_options else ())
