"""The host side of decoding against a KV cache (variants/decoding.py), in flash_attn_with_kvcache's
conventions: the checks that name what is wrong with a call, and the kernel views it launches with.

    q                      (B, N_q, H, d): the new tokens' queries (N_q small: 1 when decoding)
    k_cache, v_cache       (B, N_max, H_kv, d), or paged: (num_pages, page_size, H_kv, d)
    cache_seqlens          (B,) int32: tokens already in sequence b's cache (this and the other
                           index arrays may be torch or CuPy integers of another width:
                           converted to int32 on the device, `as_int32`)
    block_table            (B, max_blocks) int32 (paged): page j of sequence b is
                           block_table[b, j], holding its tokens j * page_size .. (j+1) * page_size - 1
    k, v (optional)        (B, N_new, H_kv, d): appended to the cache at cache_seqlens[b] first
    cache_leftpad          (B,) int32 (optional): sequence b's keys start at cache_leftpad[b]
                           (a left-padded batch: the positions before it are padding)
    cache_batch_idx        (B,) int32 (optional): sequence b is row cache_batch_idx[b] of a
                           contiguous cache (which may hold more rows than the batch)

Sequence b then attends over its keys cache_leftpad[b] .. cache_seqlens[b] + N_new - 1 (from 0
without cache_leftpad), token i of N_q at position p = cache_seqlens[b] + N_new - N_q + i;
`window_size=(left, right)` keeps the keys p - left .. p + right (-1: no bound; causal: right = 0),
`softcap` caps the scores as Gemma 2 does, `alibi_slopes` ((H,) or (B, H) fp32) subtracts
slope·|p - key| from each score, as flash_attn_with_kvcache. A contiguous cache is the
paged one with page_size = N_max and page b for sequence b; the kernels take both as 4-D
(pages, page_size, H_kv, d) arrays, the contiguous one with no block table.

`check=True` reads cache_seqlens, the block table, cache_leftpad and cache_batch_idx back (one
small copy each) and refuses a length past the cache's capacity, a page index or cache row out of
range or a left padding past its sequence's length, naming the sequence; with check=False nothing
is read back (a CUDA graph can hold the call) and the kernels clamp page indices and cache rows
into range, so a bad table gives wrong numbers but never reads outside the cache.
"""
import math
from dataclasses import dataclass

import numpy as np

from common.hardware import elements
from common.host import arrays
from common.tile import masks
from common.host.launching import KernelView
from common.host.problem import (HALF_DTYPES, _check_layout, _score_vector, check_block_table,
                                 misaligned, remember, torch_call_key)


@dataclass
class DecodeProblem:
    batch: int
    n_q: int
    heads: int
    heads_kv: int
    head_dim: int
    n_new: int             # tokens appended to each sequence's cache by this call (k, v)
    capacity: int          # keys a sequence's cache holds (N_max, or max_blocks * page_size)
    page_size: int         # N_max for a contiguous cache
    paged: bool
    dtype: str
    softmax_scale: float
    causal: bool
    max_seqlen_k: int      # the longest sequence after the append (capacity if not read back)
    q: object              # kernel views: q (B, N_q, H, d) uint16
    k_cache: object        # (pages, page_size, H_kv, d) uint16
    v_cache: object
    k_new: object          # (B, N_new, H_kv, d) uint16, or None
    v_new: object
    block_table: object    # (B, max_blocks) int32, or a placeholder
    cache_seqlens: object  # (B,) int32
    cache_leftpad: object  # (B,) int32, or a placeholder (leftpad False)
    cache_batch_idx: object  # (B,) int32, or a placeholder (batch_idx False)
    alibi: object          # ALiBi slopes, fp32 flat ((H,) or (B, H)), or a placeholder
    leftpad: bool
    batch_idx: bool
    has_alibi: bool
    alibi_stride: int      # slopes a sequence: H for (B, H) slopes, 0 for one (H,) for all
    window_left: int       # keys a token sees before its own position (NO_BOUND: all)
    window_right: int      # ... and after it (0 when causal; NO_BOUND: all)
    softcap: float         # as the caller gave it (0: none)
    library: str
    stream: object
    like: object

    @property
    def element(self):
        return elements.element(self.dtype)

    @property
    def kv_group(self):
        return self.heads // self.heads_kv

    @property
    def windowed(self):
        return self.window_left < NO_BOUND or (self.window_right < NO_BOUND and not self.causal)

    @property
    def softcap_raw(self):
        """softcap / softmax_scale: the cap on raw scores q.k (masks.Band's)."""
        return self.softcap / self.softmax_scale if self.softcap else 0.0

    @property
    def keys_seen(self):
        """The most keys one sequence's tokens see together (the split heuristic's length)."""
        if self.window_left < NO_BOUND and (self.causal or self.window_right < NO_BOUND):
            right = 0 if self.causal else self.window_right
            return min(self.max_seqlen_k, self.window_left + right + self.n_q)
        return self.max_seqlen_k

    @property
    def page_shift(self):
        """log2(page_size) of a paged cache (0 for a contiguous one: unused)."""
        return self.page_size.bit_length() - 1 if self.paged else 0


# The per-call path (as common/host/problem.py's for the forward): with check=False nothing depends on
# the data, so the first call with a geometry (every tensor's shape, strides, dtype and device, and
# the options) runs every check and keeps the problem as a template without its addresses; later
# calls with that key read the addresses, check their alignment and read the current stream.
# torch tensors only; anything else (check=True, other libraries, a misaligned address) takes the
# checked path, so errors are unchanged.
NO_BOUND = 1 << 30     # a window side with no bound, as the kernels take it
_TEMPLATES = {}
_PER_CALL = ("q", "k_cache", "v_cache", "k_new", "v_new", "block_table", "cache_seqlens",
             "cache_leftpad", "cache_batch_idx", "alibi", "stream", "like")
_OPTIONAL = {"block_table": "paged", "cache_leftpad": "leftpad", "cache_batch_idx": "batch_idx",
             "alibi": "has_alibi"}


class _DecodeTemplate:
    """A DecodeProblem of torch tensors without its addresses and stream."""

    def __init__(self, prob):
        self.fields = {f: (None if f in _PER_CALL else x) for f, x in vars(prob).items()}
        for f, flag in _OPTIONAL.items():
            if not getattr(prob, flag):    # a placeholder: the same array every call
                self.fields[f] = getattr(prob, f)
        self.layouts = {}
        for f in _PER_CALL[:10]:
            x = getattr(prob, f)
            if x is not None and (f not in _OPTIONAL or getattr(prob, _OPTIONAL[f])):
                self.layouts[f] = x.layout
        self.device = prob.like.device.index

    def problem(self, tensors):
        """The problem over `tensors` (name -> tensor, the _PER_CALL views' arrays; None: an
        address is not 16-byte aligned)."""
        ptrs = {f: x.data_ptr() for f, x in tensors.items()}
        if misaligned(*(ptrs[f] for f in ("q", "k_cache", "v_cache", "k_new", "v_new")
                        if f in ptrs)):
            return None
        prob = DecodeProblem.__new__(DecodeProblem)
        prob.__dict__.update(self.fields)
        for f, layout in self.layouts.items():
            setattr(prob, f, KernelView.over(ptrs[f], layout, tensors[f]))
        prob.stream = arrays.torch_stream(self.device)
        prob.like = tensors["q"]
        return prob


def prepare_decode(q, k_cache, v_cache, cache_seqlens, *, k, v, block_table, causal,
                   softmax_scale, head_dims, check, cache_leftpad=None, cache_batch_idx=None,
                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """The checked DecodeProblem of a call (check: read the lengths, block table, left padding
    and cache rows back and refuse bad ones); a call with an earlier call's geometry and
    check=False only reads addresses."""
    key = None
    options = dict(cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    if not check:
        tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens}
        for f, x in (("block_table", block_table), ("k_new", k), ("v_new", v),
                     ("cache_leftpad", cache_leftpad), ("cache_batch_idx", cache_batch_idx),
                     ("alibi", alibi_slopes)):
            if x is not None:
                tensors[f] = x
        window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
        key = torch_call_key(tuple(tensors.values()), (
            tuple(tensors), bool(causal), softmax_scale, tuple(head_dims), window, softcap))
        template = _TEMPLATES.get(key) if key is not None else None
        if template is not None:
            prob = template.problem(tensors)
            if prob is not None:
                return prob
    prob = _prepare_decode(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                           causal=causal, softmax_scale=softmax_scale, head_dims=head_dims,
                           check=check, **options)
    if key is not None:
        remember(_TEMPLATES, key, _DecodeTemplate(prob))
    return prob


def _prepare_decode(q, k_cache, v_cache, cache_seqlens, *, k, v, block_table, causal,
                    softmax_scale, head_dims, check, cache_leftpad, cache_batch_idx, window_size,
                    softcap, alibi_slopes):
    """prepare_decode's checked path."""
    dq, dkc, dvc = (arrays.describe(x, name) for x, name in
                    ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    for d, name in ((dq, "q"), (dkc, "k_cache"), (dvc, "v_cache")):
        if len(d.shape) != 4:
            raise ValueError(f"{name} must be 4-D, got shape {d.shape} (q: (batch, seqlen_q, "
                             "heads, head_dim); caches: (batch, seqlen_max, heads_kv, head_dim) "
                             "or paged (num_pages, page_size, heads_kv, head_dim))")
        if d.dtype not in HALF_DTYPES:
            raise TypeError(f"{name} has dtype {d.dtype}; decode takes {' or '.join(HALF_DTYPES)}")
    if not dq.dtype == dkc.dtype == dvc.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {dq.dtype}, {dkc.dtype}, "
                        f"{dvc.dtype}")
    if dkc.shape != dvc.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {dkc.shape} and "
                         f"{dvc.shape}")
    b, n_q, h, d = dq.shape
    pages, page_size, h_kv, d_kv = dkc.shape
    if d_kv != d:
        raise ValueError(f"q has head_dim {d} but the caches have head_dim {d_kv}")
    if d not in head_dims:
        raise ValueError(f"decode supports head_dim in {tuple(head_dims)}, got {d}")
    if min(b, n_q, h, h_kv) < 1:
        raise ValueError(f"empty problem: q {dq.shape}, caches {dkc.shape}")
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of the caches' {h_kv}")
    for x, name in ((dq, "q"), (dkc, "k_cache"), (dvc, "v_cache")):
        _check_layout(x, name)

    lens = arrays.describe(cache_seqlens, "cache_seqlens")
    if lens.dtype != "int32" or lens.shape != (b,):
        raise ValueError(f"cache_seqlens must be int32 of shape ({b},), got {lens.dtype} "
                         f"{lens.shape}")
    paged = block_table is not None
    if paged:
        table = arrays.describe(block_table, "block_table")
        if table.dtype != "int32" or len(table.shape) != 2 or table.shape[0] != b:
            raise ValueError(f"block_table must be int32 of shape ({b}, max_blocks), got "
                             f"{table.dtype} {table.shape}")
        if page_size & (page_size - 1):
            raise ValueError(f"a paged cache's page_size (k_cache.shape[1]) must be a power of "
                             f"two, got {page_size}")
        capacity = table.shape[1] * page_size
    else:
        if pages != b and cache_batch_idx is None:
            raise ValueError(f"a contiguous cache has one row per sequence: k_cache batch {pages} "
                             f"!= q batch {b} (a paged cache needs block_table; a cache with "
                             "other rows, cache_batch_idx)")
        capacity = page_size
    vectors = {}
    for x, name in ((cache_leftpad, "cache_leftpad"), (cache_batch_idx, "cache_batch_idx")):
        if x is not None:
            dx = arrays.describe(x, name)
            if dx.dtype != "int32" or dx.shape != (b,):
                raise ValueError(f"{name} must be int32 of shape ({b},), got {dx.dtype} "
                                 f"{dx.shape}")
            vectors[name] = dx
    if cache_batch_idx is not None and paged:
        raise ValueError("cache_batch_idx picks rows of a contiguous cache; with a block_table "
                         "each sequence's pages already say where it lies (pass one or the other)")
    # a side as long as the cache bounds nothing (flash_attn makes it -1: the call is then not
    # "local", which decides where RoPE places the queries)
    left, right = masks.window_of(window_size)
    left = NO_BOUND if left < 0 or left >= capacity else left
    right = 0 if causal else (NO_BOUND if right < 0 or right >= capacity else right)
    try:
        softcap = float(softcap or 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"softcap must be a number >= 0 (0: none), got {softcap!r}") from None
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap}")
    alibi, alibi_stride = arrays.placeholder(dq.library, 1, q, "float32"), 0
    if alibi_slopes is not None:
        slopes = _score_vector(_Shape(dq.library, b, h), alibi_slopes, "alibi_slopes",
                               ((h,), (b, h)))
        alibi, alibi_stride = arrays.bits_view(slopes, np.float32), (h if slopes.shape[0] > h
                                                                      else 0)

    n_new = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append to the cache, or neither")
    if k is not None:
        dk, dv = arrays.describe(k, "k"), arrays.describe(v, "v")
        if dk.shape != dv.shape or len(dk.shape) != 4 or dk.shape[0] != b or \
                dk.shape[2:] != (h_kv, d):
            raise ValueError(f"k and v (the new tokens) must both be ({b}, N_new, {h_kv}, {d}), "
                             f"got {dk.shape} and {dv.shape}")
        if dk.dtype != dq.dtype or dv.dtype != dq.dtype:
            raise TypeError(f"k, v must have q's dtype {dq.dtype}, got {dk.dtype}, {dv.dtype}")
        _check_layout(dk, "k")
        _check_layout(dv, "v")
        n_new = dk.shape[1]

    max_k = capacity
    if check:
        lens_host = arrays.to_host(cache_seqlens)   # one read back, for both checks
        max_k = _check_lengths(lens_host, n_new, capacity)
        if paged:
            check_block_table(arrays.to_host(block_table), lens_host + n_new, page_size, pages)
        if cache_leftpad is not None:
            _check_leftpad(arrays.to_host(cache_leftpad), lens_host)
        if cache_batch_idx is not None:
            _check_rows(arrays.to_host(cache_batch_idx), pages)

    u16 = np.uint16
    k_new = v_new = None
    if k is not None:
        k_new, v_new = arrays.bits_view(dk, u16), arrays.bits_view(dv, u16)
    return DecodeProblem(
        batch=b, n_q=n_q, heads=h, heads_kv=h_kv, head_dim=d, n_new=n_new, capacity=capacity,
        page_size=page_size, paged=paged, dtype=dq.dtype,
        softmax_scale=float(softmax_scale) if softmax_scale is not None else float(d) ** -0.5,
        causal=bool(causal), max_seqlen_k=int(max_k),
        q=arrays.bits_view(dq, u16), k_cache=arrays.bits_view(dkc, u16),
        v_cache=arrays.bits_view(dvc, u16), k_new=k_new, v_new=v_new,
        block_table=arrays.bits_view(table, np.int32) if paged else
        arrays.placeholder(dq.library, 2, q, "int32"),
        cache_seqlens=arrays.bits_view(lens, np.int32),
        cache_leftpad=_vector_view(vectors.get("cache_leftpad"), dq.library, q),
        cache_batch_idx=_vector_view(vectors.get("cache_batch_idx"), dq.library, q),
        alibi=alibi, has_alibi=alibi_slopes is not None, alibi_stride=alibi_stride,
        leftpad=cache_leftpad is not None, batch_idx=cache_batch_idx is not None,
        window_left=left, window_right=right, softcap=softcap, library=dq.library,
        stream=arrays.stream_of(dq), like=q)


@dataclass
class _Shape:
    """What problem._score_vector reads of a problem."""
    library: str
    batch: int
    heads: int


def as_int32(x):
    """An integer index array (lengths, a block table, left padding, cache rows) as the int32 one
    the kernels read: torch and CuPy integer arrays of another width converted (a copy, on the
    device), contiguous; anything else as it is (its checks name what is wrong)."""
    if x is None:
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() \
                and x.dtype != torch.bool and (x.dtype != torch.int32 or not x.is_contiguous()):
            return x.to(torch.int32).contiguous()
    elif mod.startswith("cupy"):
        if x.dtype.kind in "iu" and (x.dtype != np.int32 or not x.flags.c_contiguous):
            import cupy
            return cupy.ascontiguousarray(x, dtype=np.int32)
    return x


def _vector_view(d, library, like):
    """An optional (B,) int32 argument's kernel view, or the placeholder."""
    if d is None:
        return arrays.placeholder(library, 1, like, "int32")
    return arrays.bits_view(d, np.int32)


def _check_leftpad(leftpad, lens):
    """Each sequence's first key lies inside it: 0 <= cache_leftpad[b] <= cache_seqlens[b]."""
    for b, (pad, n) in enumerate(zip(leftpad, lens)):
        if not 0 <= pad <= n:
            raise ValueError(f"cache_leftpad[{b}] = {pad} must be 0 .. cache_seqlens[{b}] = {n}")


def _check_rows(rows, n_rows):
    """Every cache_batch_idx entry is a row of the cache."""
    bad = np.flatnonzero((rows < 0) | (rows >= n_rows))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of the cache "
                         f"(0 .. {n_rows - 1})")


def _check_lengths(lens, n_new, capacity):
    """The longest sequence after the append, or the error naming the first bad length."""
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} is negative")
        if n + n_new > capacity:
            raise ValueError(f"sequence {b}: cache_seqlens[{b}] = {n} plus {n_new} new tokens "
                             f"exceeds the cache's capacity of {capacity} tokens")
    return int(lens.max()) + n_new if len(lens) else 0
