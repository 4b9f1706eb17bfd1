"""The variants as a torch.autograd.Function: a drop-in attention for a model.

    import variants
    o = variants.attention(q, k, v, variant="fa2", causal=True)   # q, k, v: torch CUDA tensors
    o.float().pow(2).sum().backward()                            # q.grad, k.grad, v.grad

q: (batch, seqlen_q, heads, head_dim), k and v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
bf16, as in flash_attn_func. The forward saves q, k, v, O and L = LSE (nothing N x N); the backward
runs the same variant's backward pass, which recomputes P from them. alibi_slopes ((H,) or (B, H)
fp32, no gradient) and sinks ((H,) fp32, differentiable: gpt-oss's learnable sinks) are fa2's and
fa3's score terms (common/host/problem.py: with_score_terms). dropout_p > 0 (fa2): dropout on P
with a mask drawn in the kernels by Philox from torch's CUDA generator (its seed, and an offset
the call advances as torch's own dropout does: `philox_seed_offset`), so torch.manual_seed
reproduces it and the backward regenerates the forward's mask. `forward_options` and
`backward_options` are the variant's knobs (e.g. backward_options={"dq": "separate"}).
torch is imported only when this is called. Under torch.compile the same calls go to the custom
operators of variants/torch_ops.py instead, which the compiler can trace.
"""
from functools import lru_cache


@lru_cache(maxsize=None)
def _function_class():
    import torch

    from variants import registry

    class FlashAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, alibi_slopes, sinks, variant, causal, softmax_scale, mask,
                    forward_options, backward_options, dropout_p, generator, mods):
            terms = dict(_terms(alibi_slopes, sinks), **_dropout(q, dropout_p, generator),
                         **dict(mods))
            o, lse = registry.forward(q, k, v, variant=variant, causal=causal,
                                      softmax_scale=softmax_scale, **dict(mask), **terms,
                                      **dict(forward_options))
            ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, sinks)
            drop = {n: x for n, x in terms.items() if n.startswith("dropout")}
            ctx.settings = (variant, causal, softmax_scale,
                            dict(mask, **dict(backward_options), **drop, **dict(mods)))
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, o, lse, alibi_slopes, sinks = ctx.saved_tensors
            variant, causal, softmax_scale, options = ctx.settings
            grads = registry.backward(do.contiguous(), q, k, v, o, lse, variant=variant,
                                      causal=causal, softmax_scale=softmax_scale,
                                      **_terms(alibi_slopes, sinks), **options)
            return tuple(grads[:3]) + (None, _sink_grad(grads, sinks)) + (None,) * 9

    class FlashAttentionVarlenFunction(torch.autograd.Function):
        """The same over a packed batch (flash_attn_varlen_func): forward_varlen, backward_varlen."""

        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks, variant, causal,
                    softmax_scale, mask, forward_options, backward_options, dropout_p,
                    generator):
            drop = _dropout(q, dropout_p, generator)
            o, lse = registry.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, variant=variant,
                                             causal=causal, softmax_scale=softmax_scale,
                                             **dict(mask), **_terms(alibi_slopes, sinks), **drop,
                                             **dict(forward_options))
            ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi_slopes, sinks)
            ctx.settings = (variant, max_q, max_k, causal, softmax_scale,
                            dict(mask, **dict(backward_options), **drop))
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, o, lse, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
            variant, max_q, max_k, causal, softmax_scale, options = ctx.settings
            grads = registry.backward_varlen(do.contiguous(), q, k, v, o, lse, cu_q, cu_k,
                                             max_q, max_k, variant=variant, causal=causal,
                                             softmax_scale=softmax_scale,
                                             **_terms(alibi_slopes, sinks), **options)
            return tuple(grads[:3]) + (None,) * 5 + (_sink_grad(grads, sinks),) + (None,) * 8

    return FlashAttentionFunction, FlashAttentionVarlenFunction


def _terms(alibi_slopes, sinks):
    """The score-term keywords of a call: only those given (so a call without them keeps the
    variants' plain signatures and their replay)."""
    terms = {}
    if alibi_slopes is not None:
        terms["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        terms["sinks"] = sinks
    return terms


def philox_seed_offset(device, generator=None, increment=4):
    """(seed, offset) for one call's dropout mask from torch's CUDA generator of `device` (or
    `generator`), advancing its offset by `increment` as torch's own dropout kernels do, so that
    the next call draws another mask and torch.manual_seed(s) replays the sequence."""
    import torch
    if generator is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    seed, offset = generator.initial_seed(), generator.get_offset()
    generator.set_offset(offset + increment)
    return seed, offset


def _dropout(q, dropout_p, generator):
    """The dropout keywords of a call (none without dropout: the plain signatures and replay)."""
    if not dropout_p:
        return {}
    seed, offset = philox_seed_offset(q.device, generator)
    return dict(dropout_p=float(dropout_p), dropout_seed=seed, dropout_offset=offset)


def _sink_grad(grads, sinks):
    """d sinks, in the sinks' dtype, where they were given (the backward's fourth gradient)."""
    if sinks is None:
        return None
    return grads[3].to(sinks.dtype)


def _fp32(x, name):
    """A score term as the kernels take it: a contiguous fp32 tensor (differentiable: the cast
    passes sinks' gradient back), or None."""
    if x is None:
        return None
    if not hasattr(x, "contiguous"):
        raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
    return x.float().contiguous()


def _mods(score_mod, mask_mod, score_mod_grad, aux):
    """The score_mod keywords of a call (common/host/mods.py), only those given."""
    given = dict(score_mod=score_mod, mask_mod=mask_mod, score_mod_grad=score_mod_grad,
                 aux=None if aux is None else tuple(aux))
    return tuple((n, x) for n, x in given.items() if x is not None)


def _refuse_compiled_mods(mods):
    if mods:
        raise NotImplementedError("score_mod / mask_mod under torch.compile: not built yet (the "
                                  "custom operators take no functions); run the attention "
                                  "eagerly (torch.compiler.disable)")


def _mask(window_size, softcap, align):
    if softcap or align != "bottom_right" or tuple(window_size) != (-1, -1):
        return (("window_size", tuple(window_size)), ("softcap", softcap), ("align", align))
    return ()


def _options(options):
    return tuple(sorted(options.items())) if options else ()


def _compiling():
    import torch
    return torch.compiler.is_compiling()


def _check_torch(q, name):
    if type(q).__module__.split(".")[0] != "torch":
        raise TypeError(f"{name}() is the torch autograd wrapper; q is a {type(q).__name__}. "
                        "For CuPy or Numba arrays call variants.forward / variants.backward")


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     variant="fa2", causal=False, softmax_scale=None, window_size=(-1, -1),
                     softcap=0.0, align="bottom_right", alibi_slopes=None, sinks=None,
                     dropout_p=0.0, generator=None, forward_options=None, backward_options=None,
                     return_lse=False):
    """attention() over a packed batch of sequences, as flash_attn_varlen_func: q (total_q, H, d),
    k, v (total_k, H_kv, d), int32 cu_seqlens (batch + 1); differentiable in q, k, v (and sinks).
    Returns o, or (o, lse (H, total_q)) with return_lse (lse carries no gradient)."""
    _check_torch(q, "attention_varlen")
    if _compiling():   # torch.compile traces the custom operators (variants/torch_ops.py)
        _refuse_compiled_dropout(dropout_p)
        from variants import torch_ops
        return torch_ops.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            alibi_slopes=_fp32(alibi_slopes, "alibi_slopes"), sinks=_fp32(sinks, "sinks"),
            variant=variant,
            causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            align=align, forward_options=forward_options, backward_options=backward_options,
            return_lse=return_lse)
    o, lse = _function_class()[1].apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                        int(max_seqlen_k), _fp32(alibi_slopes, "alibi_slopes"),
                                        _fp32(sinks, "sinks"), variant, causal, softmax_scale,
                                        _mask(window_size, softcap, align),
                                        _options(forward_options), _options(backward_options),
                                        dropout_p, generator)
    return (o, lse) if return_lse else o


def _refuse_compiled_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p} under torch.compile: not built yet (the "
                                  "custom operators take no dropout); run the attention eagerly "
                                  "(torch.compiler.disable) or without dropout")


def attention(q, k, v, *, variant="fa2", causal=False, softmax_scale=None, window_size=(-1, -1),
              softcap=0.0, align="bottom_right", alibi_slopes=None, sinks=None, dropout_p=0.0,
              generator=None, forward_options=None, backward_options=None, return_lse=False,
              score_mod=None, mask_mod=None, score_mod_grad=None, aux=None):
    """O = softmax(softmax_scale Q K^T) V with the named variant, differentiable in q, k, v (and
    sinks); the mask (causal, window_size, softcap, align) as flash_attn_func's
    (common/tile/masks.py), the score terms alibi_slopes and sinks (fa2, fa3), dropout_p (fa2;
    torch's CUDA generator, or `generator`, gives the seed and offset), score_mod, mask_mod,
    score_mod_grad and aux (fa2, fa3: common/host/mods.py; a gradient into aux is the
    score_mod_grad's to accumulate, autograd does not see it). Returns o, or
    (o, lse (B, H, N_q) fp32) with return_lse (lse carries no gradient)."""
    _check_torch(q, "attention")
    mods = _mods(score_mod, mask_mod, score_mod_grad, aux)
    if _compiling():   # torch.compile traces the custom operators (variants/torch_ops.py)
        _refuse_compiled_dropout(dropout_p)
        _refuse_compiled_mods(mods)
        from variants import torch_ops
        return torch_ops.attention(q, k, v, alibi_slopes=_fp32(alibi_slopes, "alibi_slopes"),
                                   sinks=_fp32(sinks, "sinks"), variant=variant, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size,
                                   softcap=softcap, align=align, forward_options=forward_options,
                                   backward_options=backward_options, return_lse=return_lse)
    o, lse = _function_class()[0].apply(q, k, v, _fp32(alibi_slopes, "alibi_slopes"),
                                        _fp32(sinks, "sinks"), variant, causal, softmax_scale,
                                        _mask(window_size, softcap, align),
                                        _options(forward_options), _options(backward_options),
                                        dropout_p, generator, mods)
    return (o, lse) if return_lse else o
