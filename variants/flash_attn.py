"""flash_attn's functions on this codebase's kernels: the same names, arguments, defaults and
returns as flash_attn 2.x (`flash_attn.flash_attn_interface`), so that code written for it runs
unchanged after one import line:

    from variants.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    out = flash_attn_func(q, k, v, causal=True)          # q (B, N_q, H, d), k, v (B, N_k, H_kv, d)

They pick the generation for the GPU (fa3 on sm_90, fa2 elsewhere; `variant=` overrides it), are
differentiable for torch tensors (variants/autograd.py; under torch.compile the custom operators
of variants/torch_ops.py), and take CuPy or Numba device arrays too (forward only). Beyond
flash_attn 2: FA3's `q_descale`, `k_descale`, `v_descale` for e4m3 inputs (fa3), and FA4's
`learnable_sink` (gpt-oss's attention sinks, differentiable) in flash_attn_func and
flash_attn_varlen_func.

What flash_attn does that these do too: head dims that are not a multiple of 8 (or below 32) are
zero-padded inside and the padding cut off again (exact: zero columns add nothing to Q K^T, and
softmax_scale defaults to the unpadded d^-1/2), and a V head dim other than Q's (FA3's hdim_v) is
padded to the wider of the two (exact; it costs the wider head dim: no kernel of its own yet); `deterministic=True` runs a backward whose every
sum has one order (fa2's dQ by a separate query-block-outer kernel, `dq="separate"`; for fa3
that is FA2's backward kernels); `return_attn_probs=True` returns (out, softmax_lse, None) (the
third, flash_attn's dropout-mask debug tensor, is only filled there when dropout_p > 0);
`alibi_slopes` ((H,) or (B, H) fp32, fa2 and fa3, forward and backward); `dropout_p` > 0
(torch tensors; fa2's kernels on every GPU, as FA3 has no dropout): a Philox mask made in the
kernels from torch's CUDA generator (`torch.manual_seed` reproduces it; the backward regenerates
it), kept values scaled by 1 / (1 - p) (common/tile/dropout.py; its `keep_mask` is the mask, for
tests: `return_attn_probs` gives no S_dmask).
FA3's `attention_chunk` (Llama 4's chunked local attention) and, in the varlen functions,
`seqused_q` / `seqused_k`: a packed batch of other sequences over the same rows (the chunks; the
used rows, the unused queries with no key, the unused keys with no query), exact.
flash_attn_varlen_func's `block_table`: the keys and values in the pages of a cache (fa2's forward,
no backward, as flash_attn's). flash_attn_with_kvcache takes every argument of flash_attn 2's
(variants/decoding.py). What they refuse, naming the argument: FA3's `qv` and `num_splits` > 1.
"""
from functools import lru_cache

from variants import autograd, registry

# The head dims the kernels take: multiples of 8 from 32 to 256 (common/tile/tiles.py HEAD_DIMS).
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 32, 256

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "default_variant"]


# --------------------------------------------------------------------------- choices
def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


@lru_cache(maxsize=None)
def _numba_capability():
    """(major, minor) of Numba's current device ((0, 0) in the simulator)."""
    from common.hardware.target import SIMULATOR
    if SIMULATOR:
        return (0, 0)
    from numba import cuda
    return tuple(cuda.get_current_device().compute_capability)


def default_variant(q):
    """The generation flash_attn's functions run on q's GPU: fa3 on Hopper (sm_90), fa2 elsewhere
    (and in the simulator). For torch tensors torch.cuda.get_device_capability, which
    torch.compile folds to a constant."""
    if _is_torch(q):
        import torch
        capability = tuple(torch.cuda.get_device_capability(q.device))
    else:
        capability = _numba_capability()
    return "fa3" if capability == (9, 0) else "fa2"


def _refuse(**others):
    """NotImplementedError naming each argument flash_attn takes that these cannot honour yet."""
    for name, value in others.items():
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by variants' flash_attn functions yet")


def _refuse_fa3(num_splits):
    """NotImplementedError for FA3's options the kernels cannot honour yet."""
    if num_splits not in (0, 1):
        raise NotImplementedError(f"num_splits={num_splits}: the forward splits no keys (the "
                                  "split-KV kernel is flash_attn_with_kvcache's)")


def _backward_options(variant, deterministic):
    """deterministic=True: a backward with one summation order (bitwise reproducible)."""
    if not deterministic:
        return None
    return {"kernel": "fa2", "dq": "separate"} if variant == "fa3" else {"dq": "separate"}


def _padded(head_dim):
    """The head dim the kernels run for `head_dim` (flash_attn rounds up to a multiple of 8)."""
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be 1 .. {_MAX_HEAD_DIM}, got {head_dim}")
    return max(_MIN_HEAD_DIM, -(-head_dim // 8) * 8)


def _pad_head_dims(q, k, v):
    """q, k, v zero-padded along head_dim to what the kernels take (torch: differentiable, and only
    when needed): one head dim, a multiple of 8 from 32, for all three. A V head dim other than
    Q's and K's (FA3's hdim_v: DeepSeek's 192 / 128, or 64 / 128) pads the narrower side to the
    wider: zero columns of Q and K add nothing to Q K^T, zero columns of V give zero columns of O,
    cut off again (exact, at the cost of the wider head dim). Returns (q, k, v, d_qk, d_v)."""
    d, dk, dv = (tuple(x.shape)[-1] for x in (q, k, v))   # (a simulator shape: no shape[-1])
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    padded = _padded(max(d, dv))
    if padded == d == dv:
        return q, k, v, d, dv
    if not _is_torch(q):
        what = f"head_dim {d}" if d == dv else f"head dims {d} (q, k) and {dv} (v)"
        raise ValueError(f"{what}: the kernels take one head dim for q, k and v, a multiple of 8 "
                         "from 32 to 256; torch tensors are padded inside, CuPy / Numba arrays "
                         "must come padded")
    import torch.nn.functional as F

    def pad(x, width):   # only where needed: F.pad copies even a pad of nothing
        return x if width == padded else F.pad(x, (0, padded - width))

    return pad(q, d), pad(k, d), pad(v, dv), d, dv


def _attention(q, k, v, varlen, *, softmax_scale, causal, window_size, softcap, deterministic,
               return_lse, variant, forward_options=None, alibi_slopes=None, sinks=None,
               dropout_p=0.0):
    """The one path of every dense and packed function: (o, lse) or o, head dims padded;
    alibi_slopes and sinks (FA4's learnable_sink) as variants.attention takes them; dropout_p
    on fa2's kernels (FA3 has no dropout)."""
    if dropout_p:
        if not _is_torch(q):
            raise NotImplementedError(f"dropout_p={dropout_p} with {type(q).__name__} arrays: "
                                      "flash_attn's functions draw the mask from torch's "
                                      "generator; call variants.forward(..., dropout_p=, "
                                      "dropout_seed=, dropout_offset=) instead")
        variant = variant or "fa2"
    variant = variant or default_variant(q)
    if _is_torch(q):   # flash_attn's maybe_contiguous: a head_dim axis with a stride is copied
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    softcap = max(softcap or 0.0, 0.0)   # flash_attn: <= 0 means off
    q, k, v, d, d_v = _pad_head_dims(q, k, v)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    mask = dict(causal=causal, softmax_scale=scale, window_size=tuple(window_size),
                softcap=softcap)
    terms = {name: x for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
             if x is not None}
    if _is_torch(q):
        if varlen:
            out = autograd.attention_varlen(q, k, v, *varlen, variant=variant,
                                            dropout_p=dropout_p,
                                            forward_options=forward_options,
                                            backward_options=_backward_options(variant,
                                                                               deterministic),
                                            return_lse=True, **mask, **terms)
        else:
            out = autograd.attention(q, k, v, variant=variant, dropout_p=dropout_p,
                                     forward_options=forward_options,
                                     backward_options=_backward_options(variant, deterministic),
                                     return_lse=True, **mask, **terms)
    elif varlen:
        out = registry.forward_varlen(q, k, v, *varlen, variant=variant, **mask, **terms,
                                      **(forward_options or {}))
    else:
        out = registry.forward(q, k, v, variant=variant, **mask, **terms,
                               **(forward_options or {}))
    o, lse = out
    if tuple(o.shape)[-1] != d_v:   # padded inside (torch only)
        o = o[..., :d_v]
    return (o, lse, None) if return_lse else o


# --------------------------------------------------------------------------- dense batches
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None, v_descale=None,
                    qv=None, attention_chunk=0, num_splits=1, pack_gqa=None, sm_margin=0,
                    learnable_sink=None, variant=None):
    """out = softmax(softmax_scale q k^T + mask) v: q (B, N_q, H, d), k and v (B, N_k, H_kv, d)
    with H a multiple of H_kv (MQA / GQA); fp16 or bf16 (e4m3 with the descales: fa3).

    causal: the bottom-right diagonal (the last query sees the last key); window_size=(left,
    right): query i sees keys i + N_k - N_q - left .. i + N_k - N_q + right (-1: unbounded);
    softcap > 0: scores become softcap tanh(scores / softcap); alibi_slopes ((H,) or (B, H)
    fp32): scores minus slope |i + N_k - N_q - j|; learnable_sink ((H,) fp32, FA4's keyword,
    differentiable): a logit a head joining each row's softmax (gpt-oss). A row that sees no key
    is 0. Returns out (B, N_q, H, d), or with return_attn_probs (out, softmax_lse (B, H, N_q) fp32,
    None). FA3's keywords: the descales (e4m3 inputs); attention_chunk = C > 0 (Llama 4's
    chunked local attention: each query sees the keys of its C-key chunk only, `_chunked`); `qv`
    and `num_splits` other than 0 / 1 are refused by name; `pack_gqa` and `sm_margin` (scheduling hints) are
    accepted and ignored. dropout_p: the module's docstring."""
    _refuse(qv=qv)
    _refuse_fa3(num_splits)
    descales = {name: x for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                                        ("v_descale", v_descale)) if x is not None}
    run = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
               softcap=softcap, deterministic=deterministic, return_lse=return_attn_probs,
               variant=variant, forward_options=descales or None, alibi_slopes=alibi_slopes,
               sinks=learnable_sink, dropout_p=dropout_p)
    if attention_chunk and attention_chunk < k.shape[1]:
        return _chunked(q, k, v, int(attention_chunk), run)
    return _attention(q, k, v, None, **run)


def _chunked(q, k, v, chunk, run):
    """FA3's attention_chunk = C (Llama 4's chunked local attention) on a dense batch: each batch
    element a sequence of the packed form, cut by `_chunk_pieces` (over views of q, k, v: the
    rows do not move); returns what flash_attn_func returns (softmax_lse (B, H, N_q))."""
    batch, n_q, heads = (int(x) for x in tuple(q.shape)[:3])
    n_k = int(tuple(k.shape)[1])
    if run["return_lse"] and not _is_torch(q):
        raise NotImplementedError("attention_chunk with return_attn_probs takes torch tensors")
    pieces = [(b * n_q + q0, b * n_q + q1, b * n_k + k0, b * n_k + k1) for b in range(batch)
              for q0, q1, k0, k1 in _chunk_pieces(n_q, n_k, chunk)]
    flat = [x.reshape(batch * int(tuple(x.shape)[1]), *tuple(x.shape)[2:]) for x in (q, k, v)]
    out = _attention(*flat, _packed(q, pieces), **_one_slope_row(run, "attention_chunk"))
    if not run["return_lse"]:
        return out.reshape(batch, n_q, *tuple(out.shape)[1:])
    o, lse, probs = out
    return (o.reshape(batch, n_q, *tuple(o.shape)[1:]),
            lse.reshape(heads, batch, n_q).permute(1, 0, 2).contiguous(), probs)


def _chunk_pieces(n_q, n_k, chunk):
    """One sequence under attention_chunk = C: query i, at key position p = i + N_k - N_q, sees
    only the keys of its chunk, C floor(p / C) .. C floor(p / C) + C - 1, within its mask. Each
    chunk is then an attention of its own: its keys and the queries placed in it, bottom-right
    aligned (a chunk's queries end at its last key, or at N_k), with distances, windows and the
    causal diagonal as in the whole. Returns (q_lo, q_hi, k_lo, k_hi) a chunk, in order, rows
    relative to the sequence's first (a chunk no query reaches: no queries)."""
    shift = n_k - n_q
    if chunk < 1 or shift < 0:
        raise NotImplementedError(f"attention_chunk={chunk}: takes a positive chunk and N_q <= N_k "
                                  f"(got N_q={n_q}, N_k={n_k})")
    pieces = []
    for k0 in range(0, max(n_k, 1), chunk):
        k1 = min(k0 + chunk, n_k)
        pieces.append((min(max(k0 - shift, 0), n_q), min(max(k1 - shift, 0), n_q), k0, k1))
    return pieces


def _packed(like, pieces):
    """The varlen arguments (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed
    batch whose sequences are `pieces`, (q_lo, q_hi, k_lo, k_hi) row ranges that tile the rows in
    order; the cu_seqlens made on `like`'s device, in its library."""
    import numpy as np
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 4)
    cu_q = np.append(p[:, 0], p[-1, 1]).astype(np.int32)
    cu_k = np.append(p[:, 2], p[-1, 3]).astype(np.int32)
    max_q, max_k = int((p[:, 1] - p[:, 0]).max()), int((p[:, 3] - p[:, 2]).max())
    if _is_torch(like):
        import torch
        cu_q, cu_k = (torch.from_numpy(x).to(like.device) for x in (cu_q, cu_k))
    else:
        from common.host import arrays
        library = arrays.describe(like, "q").library
        cu_q, cu_k = (arrays.to_device(x, library) for x in (cu_q, cu_k))
    return cu_q, cu_k, max_q, max_k


def _one_slope_row(run, why):
    """run, refusing ALiBi slopes of shape (B, H) (a re-cut batch has other sequences)."""
    slopes = run.get("alibi_slopes")
    if slopes is not None and len(tuple(slopes.shape)) == 2:
        raise NotImplementedError(f"{why} with alibi_slopes of shape (B, H): not built yet ((H,) "
                                  "slopes are taken)")
    return run


def _recut_varlen(q, k, v, varlen, seqused_q, seqused_k, chunk, run):
    """flash_attn_varlen_func with FA3's seqused_q / seqused_k and attention_chunk: the packed batch
    re-cut into other sequences over the same rows (cu_seqlens read back, as the varlen path
    does anyway). seqused: sequence b's first seqused[b] rows take part; the rest of its query
    rows become a sequence of no key (O = 0, LSE = -inf) and the rest of its keys one of no query
    (gradients 0). attention_chunk: the used part cut by `_chunk_pieces`. The output and LSE keep
    the rows' layout."""
    import numpy as np

    from common.host import arrays
    cu_q, cu_k = (np.asarray(arrays.to_host(x), dtype=np.int64) for x in varlen[:2])
    batch = len(cu_q) - 1
    used = []
    for name, given, cu in (("seqused_q", seqused_q, cu_q), ("seqused_k", seqused_k, cu_k)):
        lengths = np.diff(cu)
        if given is None:
            used.append(lengths)
            continue
        u = np.asarray(arrays.to_host(given), dtype=np.int64).reshape(-1)
        if u.shape != (batch,) or (u < 0).any() or (u > lengths).any():
            raise ValueError(f"{name} must hold a length a sequence ({batch}), each at most its "
                             f"cu_seqlens span, got {u.tolist()}")
        used.append(u)
    pieces = []
    for b in range(batch):
        q0, k0, uq, uk = int(cu_q[b]), int(cu_k[b]), int(used[0][b]), int(used[1][b])
        inner = _chunk_pieces(uq, uk, chunk) if chunk and chunk < uk else [(0, uq, 0, uk)]
        pieces += [(q0 + a, q0 + c, k0 + e, k0 + f) for a, c, e, f in inner]
        pieces.append((q0 + uq, int(cu_q[b + 1]), k0 + uk, k0 + uk))   # the unused queries
        pieces.append((int(cu_q[b + 1]),) * 2 + (k0 + uk, int(cu_k[b + 1])))   # unused keys
    pieces = [p for p in pieces if p[1] > p[0] or p[3] > p[2]] or [(0, 0, 0, 0)]
    why = "seqused_q / seqused_k" if chunk == 0 else "attention_chunk"
    return _attention(q, k, v, _packed(q, pieces), **_one_slope_row(run, why))


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, variant=None):
    """flash_attn_func with k and v stacked: kv (B, N_k, 2, H_kv, d) (no copies: k and v are
    views of it, and its gradient is theirs stacked)."""
    k, v = kv.unbind(2) if _is_torch(kv) else (kv[:, :, 0], kv[:, :, 1])
    return _attention(q, k, v, None, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, deterministic=deterministic,
                      return_lse=return_attn_probs, variant=variant, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, variant=None):
    """flash_attn_func with q, k, v stacked: qkv (B, N, 3, H, d)."""
    q, k, v = qkv.unbind(2) if _is_torch(qkv) else (qkv[:, :, i] for i in range(3))
    return _attention(q, k, v, None, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap, deterministic=deterministic,
                      return_lse=return_attn_probs, variant=variant, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p)


# --------------------------------------------------------------------------- packed batches
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None, qv=None, attention_chunk=0, num_splits=1,
                           pack_gqa=None, sm_margin=0, learnable_sink=None, variant=None):
    """flash_attn_func over a packed batch of sequences: q (total_q, H, d), k and v (total_k,
    H_kv, d), cu_seqlens_q / cu_seqlens_k int32 (batch + 1) each sequence's first row, and the
    longest sequences' lengths. The mask applies within each sequence. Returns out (total_q, H,
    d), or with return_attn_probs (out, softmax_lse (H, total_q) fp32, None). FA3's `seqused_q`
    / `seqused_k` ((batch,) int32: only the first seqused[b] rows of sequence b take part; the
    other query rows get 0) and `attention_chunk` re-cut the packed batch (`_recut_varlen`);
    `qv` is refused by name."""
    _refuse(qv=qv)
    _refuse_fa3(num_splits)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    run = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
               softcap=softcap, deterministic=deterministic, return_lse=return_attn_probs,
               variant=variant, alibi_slopes=alibi_slopes, sinks=learnable_sink,
               dropout_p=dropout_p)
    if block_table is not None:
        if seqused_q is not None or seqused_k is not None or attention_chunk:
            raise NotImplementedError("block_table with seqused_q / seqused_k / attention_chunk: "
                                      "not supported together yet")
        return _paged_varlen(q, k, v, varlen, block_table, **run)
    if seqused_q is not None or seqused_k is not None or attention_chunk:
        return _recut_varlen(q, k, v, varlen, seqused_q, seqused_k, int(attention_chunk), run)
    return _attention(q, k, v, varlen, **run)


def _paged_varlen(q, k, v, varlen, block_table, *, softmax_scale, causal, window_size, softcap,
                  deterministic, return_lse, variant, alibi_slopes, sinks, dropout_p):
    """flash_attn_varlen_func over a paged cache (k, v (num_pages, page_size, H_kv, d), sequence
    b's keys in the pages block_table[b]): a prefill against the cache a decode writes. fa2's
    forward (fa3 has no paged copy yet); no backward and no dropout (flash_attn's neither); the
    head dim as the kernels take it (the cache is not copied to pad it)."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p} with block_table: the paged forward is "
                                  "for inference (no backward)")
    if variant not in (None, "fa2"):
        raise NotImplementedError(f"block_table with variant={variant!r}: the paged forward is "
                                  "fa2's")
    if _is_torch(q) and _grad_needed(q, k, v, alibi_slopes, sinks):
        raise NotImplementedError("block_table: the paged forward has no backward (as "
                                  "flash_attn's); call it under torch.no_grad()")
    d = tuple(q.shape)[-1]
    if _padded(d) != d or tuple(v.shape)[-1] != d:
        raise ValueError(f"block_table with head_dim {d} (v: {tuple(v.shape)[-1]}): the paged "
                         "cache must hold one head dim the kernels take (a multiple of 8 from 32 "
                         "to 256); it is not copied to pad it")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    terms = {name: x for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
             if x is not None}
    from common.host.kvcache import as_int32
    block_table = as_int32(block_table)   # torch's int64, say: int32 on the device
    o, lse = registry.forward_varlen(q, k, v, *varlen, variant="fa2", causal=causal,
                                     softmax_scale=scale, window_size=tuple(window_size),
                                     softcap=max(softcap or 0.0, 0.0), block_table=block_table,
                                     **terms)
    return (o, lse, None) if return_lse else o


def _grad_needed(*tensors):
    """Whether autograd would record a call on these torch tensors (None among them ignored)."""
    import torch
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *,
                                    variant=None):
    """flash_attn_varlen_func with kv (total_k, 2, H_kv, d)."""
    k, v = kv.unbind(1) if _is_torch(kv) else (kv[:, 0], kv[:, 1])
    return _attention(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, deterministic=deterministic,
                      return_lse=return_attn_probs, variant=variant, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, variant=None):
    """flash_attn_varlen_func with qkv (total, 3, H, d) and one cu_seqlens for all three."""
    q, k, v = qkv.unbind(1) if _is_torch(qkv) else (qkv[:, i] for i in range(3))
    return _attention(q, k, v, (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen),
                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, deterministic=deterministic,
                      return_lse=return_attn_probs, variant=variant, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p)


# --------------------------------------------------------------------------- KV cache
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q's new tokens (B, N_q, H, d) against each sequence's KV cache, split over the
    keys (Flash-Decoding: variants/decoding.py). k_cache, v_cache: (B, N_max, H_kv, d), or paged
    (num_blocks, page_size, H_kv, d) with block_table (B, max_blocks) int32. k, v (B, N_new,
    H_kv, d): written into the caches at cache_seqlens first (in place), then attended to.
    cache_seqlens: (B,) int32, or an int for every sequence, or None (the whole cache).
    cache_leftpad (B,) int32: sequence b's keys start there (left padding); cache_batch_idx (B,)
    int32: sequence b's row of a contiguous cache; window_size, softcap: as flash_attn_func's;
    rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2): RoPE on q and the appended k (pairs
    (2j, 2j+1) if rotary_interleaved, else (j, j + rotary_dim / 2)), at their positions;
    alibi_slopes (H,) or (B, H) fp32. Returns out like q, or (out, softmax_lse (B, H, N_q) fp32)
    with return_softmax_lse. Not differentiable (as flash_attn's)."""
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        if cache_seqlens is None and block_table is not None:
            raise ValueError("cache_seqlens is required with a block_table")
        cache_seqlens = _full(q, k_cache.shape[1] if cache_seqlens is None else cache_seqlens)
    from variants.decoding import decode
    o, lse = decode(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                    causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                    cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                    window_size=window_size, softcap=softcap, rotary_cos=rotary_cos,
                    rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                    alibi_slopes=alibi_slopes)
    return (o, lse) if return_softmax_lse else o


def _full(q, n):
    """(B,) int32 lengths, all n, in q's array library."""
    import numpy as np
    batch = q.shape[0]
    if _is_torch(q):
        import torch
        return torch.full((batch,), n, dtype=torch.int32, device=q.device)
    from common.host.arrays import describe, to_device
    return to_device(np.full(batch, n, np.int32), describe(q, "q").library)
