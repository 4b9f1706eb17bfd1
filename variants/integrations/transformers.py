"""HuggingFace transformers' `attn_implementation=` on this codebase's kernels:

    from variants.integrations import transformers as fa_transformers
    fa_transformers.register()                                   # once
    model = AutoModelForCausalLM.from_config(config, attn_implementation=fa_transformers.NAME)

`register()` adds an attention function (AttentionInterface) and its mask function
(AttentionMaskInterface: transformers' own flash-attention mask, which hands over the 2-D padding
mask or None; without a registered mask function transformers would drop the padding silently).
The name holds no "flash": transformers would then look for the flash-attn package. Each call:
- q, k, v arrive as (B, H, N, d) and go to the kernels as (B, N, H, d) views; float32 ones (RoPE
  computed in fp32, a model kept in fp32) run in the autocast dtype, else the model's 16-bit
  weight dtype, else bf16, and come back in their own dtype; a V head dim narrower than Q's
  (MLA) is padded and O cropped, as transformers does;
- causal attention is flash_attn's bottom-right diagonal (a query block of a generation step
  sees the whole cache), `sliding_window=w` is `window_size=(w - 1, 0)` (w keys including the
  query's own), `softcap` is Gemma 2's cap, `scaling` the softmax scale, `s_aux` gpt-oss's
  attention sinks (the kernels' sinks, differentiable: FA4's learnable_sink);
- a padding mask (left or right padding) unpads the batch and runs the packed-batch (varlen)
  kernels; a StaticCache's keys are cut to the mask's length first (the positions filled);
  packed sequences (`cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_*` keywords, or position_ids
  that restart) run varlen too. What a mask (or position_ids) implies, the gather indices and
  cu_seqlens, comes from one host copy of it, made by the first layer that sees it and kept on
  the tensor for the others (`_plan`): one synchronisation a forward, not several a layer;
- a few query tokens against a longer cache (a generation step) run the split-KV decode kernel
  (variants/decoding.py) with no read-back, a left-padded batch's padding as its cache_leftpad,
  windows and softcap in the kernel; everything else (and every call under
  torch.compile, which transformers uses for a StaticCache's decode steps) flash_attn_func's path
  (fa3 on sm_90, fa2 elsewhere, torch custom operators while compiling), differentiable;
- attention dropout in training (`config.attention_dropout`) is fa2's in-kernel dropout (torch's
  generator gives its seed: common/tile/dropout.py);
- what the kernels cannot do is refused by name: `output_attentions`, chunked attention (Llama 4's
  `attention_chunk_size`; its mask function is not transformers' to apply here). Padded batches
  and packed detection read values back (once a forward, as transformers' own flash path does at
  least that often), so they break a `fullgraph=True` compile.
"""
import weakref

NAME = "fa_numba"
DECODE_MAX_QUERIES = 16   # at most this many new tokens a sequence go to the split-KV kernel


def register(name=NAME):
    """Make `attn_implementation=name` run these kernels (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    if "flash" in name:
        raise ValueError(f"attn_implementation name {name!r}: a name holding 'flash' makes "
                         "transformers look for the flash-attn package; pick another")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _compute_dtype(query, module):
    """What the kernels run in: q's own 16-bit dtype; for float32 q (RoPE in fp32, a model kept
    in fp32) the autocast dtype, else the model's 16-bit weight dtype (as transformers' flash
    path picks it), else bf16."""
    import torch
    half = (torch.float16, torch.bfloat16)
    if query.dtype in half:
        return query.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is not None and linear.weight.dtype in half:
        return linear.weight.dtype
    return torch.bfloat16


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: (out (B, N_q, H, d), None)."""
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions=True: the kernels never form the "
                                  "attention matrix; use attn_implementation='eager'")
    causal = module.is_causal if is_causal is None else is_causal
    chunk = getattr(getattr(module, "config", None), "attention_chunk_size", None)
    if chunk and key.shape[2] > chunk:
        raise NotImplementedError(f"chunked attention (attention_chunk_size={chunk}, Llama 4): "
                                  "not built yet; its layers would attend to every key")
    dtype = _compute_dtype(query, module)
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:   # MLA (V narrower than Q, K): pad V, crop O, as transformers does
        import torch.nn.functional as F
        v = F.pad(v, (0, head_dim - v_head_dim))
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    mask = dict(softmax_scale=scaling, causal=causal, window_size=window,
                softcap=softcap or 0.0)
    if dropout:   # attention dropout in training (transformers passes 0.0 in eval): fa2's kernels
        mask["dropout_p"] = float(dropout)
    if s_aux is not None:   # gpt-oss's sinks, (H,) in the model's dtype: fp32 for the kernels
        mask["learnable_sink"] = s_aux
    out = _attend(q, k, v, attention_mask, mask, kwargs)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out.to(query.dtype), None


def _attend(q, k, v, padding, mask, kwargs):
    from variants import flash_attn
    plan = None
    if padding is not None:
        n = padding.shape[-1]
        if k.shape[1] > n:             # a StaticCache: only the first n positions are filled
            k, v = k[:, :n], v[:, :n]
        plan = _plan(padding, ("padding", q.shape[1]), _padding_plan)
        if plan.all_kept:
            plan = None
    if plan is not None:
        if plan.left_padded and _decodes(q, k, mask):
            return _decode(q, k, v, mask, leftpad=plan.leftpad)
        return _unpadded(q, k, v, plan, mask)
    packed = _packed_lengths(q, kwargs)
    if packed is not None:
        b, n_q = q.shape[:2]
        out = flash_attn.flash_attn_varlen_func(
            q.reshape(b * n_q, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]), *packed, **mask)
        return out.view(b, n_q, *out.shape[1:])
    if _decodes(q, k, mask):
        return _decode(q, k, v, mask)
    return flash_attn.flash_attn_func(q, k, v, **mask)


def _decodes(q, k, mask):
    """Whether a call is a generation step the split-KV decode kernel takes: a few new tokens
    against a longer cache, no sinks or dropout, a head dim and query-head group it has tiles
    for, nothing to differentiate (under torch.compile: its custom operator)."""
    from variants import decoding
    n_q, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    return (n_q <= DECODE_MAX_QUERIES < k.shape[1] and not q.requires_grad
            and mask.get("learnable_sink") is None and not mask.get("dropout_p")
            and head_dim in decoding.HEAD_DIMS
            and (heads // k.shape[2]) * n_q <= decoding.MAX_ROWS)


def _decode(q, k, v, mask, leftpad=None):
    """A generation step: q's few tokens against every key of k, v (the cache as transformers
    hands it over, all positions filled; leftpad (B,) int32: where each sequence's keys start in
    a left-padded batch), by the split-KV kernel. The lengths are k's, made here, so nothing is
    read back (check=False: no host synchronisation a layer)."""
    import torch

    lengths = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    if _compiling():   # the custom operator (a graph node; a CUDA graph may hold it)
        from variants import torch_ops
        left, right = mask["window_size"]
        o, _ = torch_ops.decode(q, k, v, lengths, leftpad, bool(mask["causal"]),
                                mask["softmax_scale"], int(left), int(right),
                                float(mask["softcap"] or 0.0), 0)
        return o
    from variants.decoding import decode
    o, _ = decode(q, k, v, lengths, causal=mask["causal"], softmax_scale=mask["softmax_scale"],
                  window_size=mask["window_size"], softcap=mask["softcap"],
                  cache_leftpad=leftpad, check=False)
    return o


def _compiling():
    import torch
    return torch.compiler.is_compiling()


def _unpadded(q, k, v, plan, mask):
    """A padded batch as a packed one: each sequence's kept keys, and its last N_q positions'
    queries (the new tokens of a padded generation step, or the whole prompt)."""
    from variants import flash_attn
    batch, n_q = q.shape[:2]
    out = flash_attn.flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:])[plan.rows], k.reshape(-1, *k.shape[2:])[plan.keys],
        v.reshape(-1, *v.shape[2:])[plan.keys], plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
        **mask)
    full = out.new_zeros(batch * n_q, *out.shape[1:])
    full[plan.rows] = out
    return full.view(batch, n_q, *out.shape[1:])


class _PaddingPlan:
    """What a padding mask (B, n) implies for calls with N_q queries (its last N_q positions):
    whether it keeps everything, whether every row is left padding (0 ... 0 1 ... 1: the decode
    kernel's cache_leftpad, `leftpad` (B,) int32), and the packed batch's gather indices (`rows`
    of the queries, `keys`), cu_seqlens (declared to prepare_varlen: no read-back) and longest
    sequences."""

    def __init__(self, padding, n_q):
        import numpy as np
        import torch

        from common.host.problem import known_seqlens
        kept = padding.bool().cpu().numpy()          # the one read-back
        device = padding.device
        self.all_kept = bool(kept.all())
        if self.all_kept:
            return
        self.left_padded = bool((np.diff(kept.astype(np.int8), axis=1) >= 0).all())
        lengths, queries = kept.sum(1), kept[:, -n_q:].sum(1)

        def put(x, dtype):
            return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype).to(device)
        self.leftpad = put(kept.shape[1] - lengths, torch.int32)
        self.keys = put(np.flatnonzero(kept.reshape(-1)), torch.int64)
        self.rows = put(np.flatnonzero(kept[:, -n_q:].reshape(-1)), torch.int64)
        starts_k = np.concatenate([[0], np.cumsum(lengths)])
        starts_q = np.concatenate([[0], np.cumsum(queries)])
        self.cu_k = known_seqlens(put(starts_k, torch.int32), starts_k)
        self.cu_q = known_seqlens(put(starts_q, torch.int32), starts_q)
        self.max_q, self.max_k = max(int(queries.max()), 1), max(int(lengths.max()), 1)


def _padding_plan(padding, key):
    return _PaddingPlan(padding, key[1])


_PLANS = {}   # id(tensor) -> (weak reference, version, {key: plan})


def _plan(tensor, key, make):
    """make(tensor, key), computed once for a tensor object (a model's forward hands the same
    mask and position_ids to every layer) and kept while it lives unchanged in place (torch's
    version counter); an inference tensor (torch.inference_mode) keeps no counter, so its plan is
    made every call."""
    from common.host.problem import version_of
    version = version_of(tensor)
    if version is None:
        return make(tensor, key)
    entry = _PLANS.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1] != version:
        ident = id(tensor)

        def forget(ref):
            if _PLANS.get(ident, (None,))[0] is ref:
                del _PLANS[ident]
        entry = _PLANS[ident] = (weakref.ref(tensor, forget), version, {})
    plans = entry[2]
    if key not in plans:
        plans[key] = make(tensor, key)
    return plans[key]


def _packed_lengths(q, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of sequences packed into one row, from the
    keywords transformers passes (DataCollatorWithFlattening) or from position_ids that restart
    at 0; None for an ordinary batch."""
    import torch
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                     "max_length_k")]
    if all(x is not None for x in given):
        cu_q, cu_k, max_q, max_k = given
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q.shape[0] != 1 or q.shape[1] < 2:
        return None
    return _plan(position_ids, ("packed",), _packed_plan)


def _packed_plan(position_ids, key):
    """transformers' rule (_is_packed_sequence, prepare_fa_kwargs_from_position_ids): one row
    whose positions are not one increasing run; every sequence restarts at the smallest
    position. From one host copy of position_ids; cu_seqlens declared (no read-back a call)."""
    import numpy as np
    import torch

    from common.host.problem import known_seqlens
    flat = position_ids.reshape(-1).cpu().numpy()
    first = flat.min()
    if (np.arange(flat.size) + first == flat).all():
        return None
    starts = np.concatenate([np.flatnonzero(flat == first), [flat.size]])
    cu = known_seqlens(torch.as_tensor(starts, dtype=torch.int32).to(position_ids.device), starts)
    longest = int(np.diff(starts).max())
    return cu, cu, longest, longest
