"""The variants as torch custom operators, so that `torch.compile` sees through them.

    model = torch.compile(model, fullgraph=True)   # model calls variants.attention(q, k, v, ...)

`torch.library.custom_op` registers two operators, `flash_numba::forward` -> (o, lse) and
`flash_numba::backward` -> (dq, dk, dv, dsinks) (and their packed-batch twins, and
`flash_numba::decode`, the split-KV decode kernel, not differentiable), each with a fake
implementation (the output shapes, dtypes and strides, from the input shapes alone: what the
compiler traces with) and the first
with its derivative (`register_autograd`: the second, from the saved q, k, v, o, lse). Dynamo
then keeps each call as one opaque node of the graph: the compiled code calls the variant's
forward and backward (Numba kernels launched on torch's current stream) between the kernels it
generated for the rest of the model, and AOTAutograd puts the backward in the compiled backward
graph, so the whole model's backward is one autograd node instead of one Python node per layer.
With mode="reduce-overhead" the compiled model also replays from CUDA graphs.

`variants.attention` calls these operators while torch.compile traces (torch.compiler.
is_compiling()) and the autograd.Function of variants/autograd.py when it runs eagerly: a custom
operator's eager call goes through the dispatcher and costs more host time than the Function.
The mask travels as plain arguments (window_size as two ints) and the variant's options as a
JSON string, the types an operator schema takes; the score terms (alibi_slopes, sinks) as optional
fp32 tensors, d sinks as the backward's fourth output (empty without sinks: a schema's outputs
are fixed). The gradient of lse is not propagated (lse is an
auxiliary output, as in flash_attn).
"""
import json
from functools import lru_cache
from typing import Optional

import torch

from variants import registry

Tensor = torch.Tensor


@torch.compiler.assume_constant_result   # called with constants: traced as its result
def encode_options(options):
    """A variant's keyword options as the JSON string the operators carry ("" for none)."""
    return json.dumps(sorted(options.items())) if options else ""


@lru_cache(maxsize=256)
def _decode_options(text):
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in json.loads(text)) \
        if text else ()


def _mask(window_left, window_right, softcap, align):
    return dict(window_size=(window_left, window_right), softcap=softcap, align=align)


def _terms(alibi_slopes, sinks):
    """The score-term keywords that are given (so that calls without them keep the variants'
    plain signatures)."""
    return {name: x for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
            if x is not None}


def _with_sink_grad(grads, sinks, like):
    """(dq, dk, dv, dsinks): d sinks the fourth (an empty fp32 tensor without sinks)."""
    dq, dk, dv = grads[:3]
    return dq, dk, dv, grads[3] if sinks is not None else like.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("flash_numba::forward", mutates_args=())
def forward(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
            sinks: Optional[Tensor], variant: str, causal: bool,
            softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
            align: str, forward_options: str, backward_options: str) -> tuple[Tensor, Tensor]:
    """(o, lse) of variants.forward; backward_options ride along for the derivative."""
    return registry.forward(
        q, k, v, variant=variant, causal=causal, softmax_scale=softmax_scale,
        **_mask(window_left, window_right, softcap, align), **_terms(alibi_slopes, sinks),
        **dict(_decode_options(forward_options)))


@forward.register_fake
def _(q, k, v, alibi_slopes, sinks, variant, causal, softmax_scale, window_left, window_right,
      softcap, align, forward_options, backward_options):
    b, n_q, h, _ = q.shape
    # the variants return o contiguous (B, N_q, H, d) in q's dtype and lse (B, H, N_q) fp32,
    # whatever q's strides
    return q.new_empty(q.shape), q.new_empty((b, h, n_q), dtype=torch.float32)


@torch.library.custom_op("flash_numba::backward", mutates_args=())
def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
             alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], variant: str,
             causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
             softcap: float, align: str,
             backward_options: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of variants.backward (dsinks empty without sinks)."""
    grads = registry.backward(do.contiguous(), q, k, v, o, lse, variant=variant, causal=causal,
                              softmax_scale=softmax_scale,
                              **_mask(window_left, window_right, softcap, align),
                              **_terms(alibi_slopes, sinks),
                              **dict(_decode_options(backward_options)))
    return _with_sink_grad(grads, sinks, q)


@backward.register_fake
def _(do, q, k, v, o, lse, alibi_slopes, sinks, variant, causal, softmax_scale, window_left,
      window_right, softcap, align, backward_options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), \
        q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, alibi, sinks, variant, causal, scale, left, right, softcap, align, _, \
        backward_options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, alibi, sinks)
    ctx.settings = (variant, causal, scale, left, right, softcap, align, backward_options)


def _derivative(ctx, do, dlse):
    q, k, v, o, lse, alibi, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = backward(do, q, k, v, o, lse, alibi, sinks, *ctx.settings)
    return (dq, dk, dv, None, dsinks if sinks is not None else None) + (None,) * 9


forward.register_autograd(_derivative, setup_context=_setup_context)


# --------------------------------------------------------------------------- packed batches
@torch.library.custom_op("flash_numba::forward_varlen", mutates_args=())
def forward_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor],
                   sinks: Optional[Tensor], variant: str, causal: bool,
                   softmax_scale: Optional[float], window_left: int, window_right: int,
                   softcap: float, align: str, forward_options: str,
                   backward_options: str) -> tuple[Tensor, Tensor]:
    """(o, lse) of variants.forward_varlen."""
    return registry.forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant=variant,
        causal=causal, softmax_scale=softmax_scale,
        **_mask(window_left, window_right, softcap, align), **_terms(alibi_slopes, sinks),
        **dict(_decode_options(forward_options)))


@forward_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
      variant, causal, softmax_scale, window_left, window_right, softcap, align, forward_options,
      backward_options):
    total_q, h, _ = q.shape   # o (total_q, H, d) contiguous, lse (H, total_q) fp32
    return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("flash_numba::backward_varlen", mutates_args=())
def backward_varlen(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                    variant: str, causal: bool,
                    softmax_scale: Optional[float], window_left: int, window_right: int,
                    softcap: float, align: str,
                    backward_options: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of variants.backward_varlen (dsinks empty without sinks)."""
    grads = registry.backward_varlen(
        do.contiguous(), q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        variant=variant, causal=causal, softmax_scale=softmax_scale,
        **_mask(window_left, window_right, softcap, align), **_terms(alibi_slopes, sinks),
        **dict(_decode_options(backward_options)))
    return _with_sink_grad(grads, sinks, q)


@backward_varlen.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
      sinks, variant, causal, softmax_scale, window_left, window_right, softcap, align,
      backward_options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), \
        q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32)


def _setup_context_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, alibi, sinks, *settings = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi, sinks)
    ctx.sizes = (max_q, max_k)
    ctx.settings = tuple(settings[:-2]) + (settings[-1],)   # all but forward_options


def _derivative_varlen(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k, alibi, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, *ctx.sizes, alibi,
                                         sinks, *ctx.settings)
    return (dq, dk, dv) + (None,) * 5 + (dsinks if sinks is not None else None,) + (None,) * 9


forward_varlen.register_autograd(_derivative_varlen, setup_context=_setup_context_varlen)


# --------------------------------------------------------------------------- decoding
@torch.library.custom_op("flash_numba::decode", mutates_args=())
def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
           cache_leftpad: Optional[Tensor], causal: bool, softmax_scale: Optional[float],
           window_left: int, window_right: int, softcap: float,
           num_splits: int) -> tuple[Tensor, Tensor]:
    """(o, lse) of variants.decode over a contiguous cache (no append, no read-back: check=False),
    so that a compiled generation step (transformers compiles a StaticCache's) keeps the split-KV
    kernel, and a CUDA graph may hold it. num_splits 0: the heuristic over the cache's
    capacity, a function of the shapes alone."""
    from variants.decoding import decode as split_kv
    return split_kv(q, k_cache, v_cache, cache_seqlens, cache_leftpad=cache_leftpad,
                    causal=causal, softmax_scale=softmax_scale,
                    window_size=(window_left, window_right), softcap=softcap,
                    num_splits=num_splits, check=False)


@decode.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_leftpad, causal, softmax_scale, window_left,
      window_right, softcap, num_splits):
    b, n_q, h, _ = q.shape    # o contiguous (B, N_q, H, d) in q's dtype, lse (B, H, N_q) fp32
    return q.new_empty(q.shape), q.new_empty((b, h, n_q), dtype=torch.float32)


# --------------------------------------------------------------------------- variants.attention
def _arguments(variant, causal, softmax_scale, window_size, softcap, align, forward_options,
               backward_options):
    """The operators' trailing arguments, from variants.attention's keywords."""
    left, right = window_size
    return (variant, bool(causal), softmax_scale, int(left), int(right), float(softcap), align,
            encode_options(forward_options), encode_options(backward_options))


def attention(q, k, v, return_lse=False, alibi_slopes=None, sinks=None, **kwargs):
    """o (or (o, lse)) of the forward operator, from variants.attention's keywords (alibi_slopes
    and sinks: fp32 contiguous tensors, as variants/autograd.py makes them)."""
    o, lse = forward(q, k, v, alibi_slopes, sinks, *_arguments(**kwargs))
    return (o, lse) if return_lse else o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     return_lse=False, alibi_slopes=None, sinks=None, **kwargs):
    """o (or (o, lse)) of the packed-batch forward operator, from variants.attention_varlen's
    keywords."""
    o, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                            int(max_seqlen_k), alibi_slopes, sinks, *_arguments(**kwargs))
    return (o, lse) if return_lse else o
