"""One attention call, checked and laid out for the kernels: every variant's `forward` starts here.

`prepare` validates q, k, v (and optional preallocated outputs) with errors that name the problem,
and returns the zero-copy views the kernels take:
  q, k, v  (B, H, N, d) uint16 (uint8 for FP8 inputs)     o32  (B, H, N_q, d/2) uint32 over the output
  lse      (B, H, N_q) float32
"""
import copy
import dataclasses
import math
import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import types

from common.hardware import elements
from common.host import arrays
from common.host.launching import KernelView
from common.tile import dropout, masks, tiles

_BSHD_TO_BHSD = (0, 2, 1, 3)
HALF_DTYPES = ("float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "uint8")   # e4m3 as torch/ml_dtypes have it, or its bits   # flash_attn_func layout (batch, seq, heads, dim) -> (batch, heads, seq, dim)

# Numba types of the views `prepare` makes (what kernels are specialised on), for compiling kernels
# ahead of time on machines without a GPU (tests/test_compile.py).
QKV_TYPE = types.Array(types.uint16, 4, "A")      # q, k, v: (B, H, N, d) permuted views
OUT_TYPE = types.Array(types.uint32, 4, "A")      # o32: (B, H, N_q, d/2) permuted view
LSE_TYPE = types.Array(types.float32, 3, "C")     # lse: (B, H, N_q)
MASK_TYPES = (types.int32, types.int32, types.float32)   # AttentionProblem.mask_args()
SEQS_TYPE = types.Array(types.int32, 1, "C")      # cu_seqlens_q, cu_seqlens_k (varlen)
F32_VEC = types.Array(types.float32, 1, "C")
SCORE_TYPES = (F32_VEC, types.int32, types.int32, F32_VEC)   # AttentionProblem.score_args()
# AttentionProblem.dropout_args(): seed (lo, hi), offset (lo, hi), the 8-bit keep threshold,
# 1 / (1 - p), and the mask's column groups a row (common/tile/dropout.py)
DROPOUT_TYPES = (types.uint32,) * 5 + (types.float32, types.int32)
# the aux arrays of score_mod / mask_mod (AttentionProblem.aux; none: an empty tuple)
MOD_TYPES = (types.Tuple(()),)
# fa2's block-mask lists (common/host/mods.py BlockMask.lists) and whether they vary by batch, head
BLOCK_MASK_TYPES = (types.Array(types.int32, 4, "C"), types.Array(types.int32, 3, "C"),
                    types.int32, types.int32)
# fa2's paged K/V (a packed batch's block_table: Pages) and log2 of the page size
PAGE_TYPES = (types.Array(types.int32, 2, "C"), types.int32)


@dataclass
class Varlen:
    """A packed batch of sequences (flash_attn_varlen_func): sequence b is rows cu_q[b] ..
    cu_q[b+1] - 1 of q (of k and v: cu_k). The kernels see q, k, v, o as one batch of one
    sequence of total_q (total_k) rows and each thread block reads its sequence's bounds."""
    cu_q: object          # int32 kernel views, batch + 1 entries
    cu_k: object
    max_q: int            # the longest sequences (the grid covers max_q rows a sequence)
    max_k: int
    bottom_right: bool    # the band's diagonal at each sequence's bottom-right corner
    starts_q: tuple = ()  # cu_q and cu_k as read back to the host (checked), batch + 1 ints
    starts_k: tuple = ()


@dataclass
class Pages:
    """A packed batch's keys and values in the pages of a cache (flash_attn_varlen_func's
    block_table): k, v (num_pages, page_size, H_kv, d), sequence b's key t at slot t mod
    page_size of page table[b, t / page_size]."""
    table: object         # int32 kernel view (batch, max_pages)
    page_size: int        # a power of two


@dataclass
class AttentionProblem:
    batch: int
    heads: int
    heads_kv: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str
    out_dtype: str
    causal: bool
    softmax_scale: float
    band: masks.Band    # the keys each query sees (causal, window_size) and softcap
    q: object
    k: object
    v: object
    o32: object
    lse: object
    o_out: object
    lse_out: object
    library: str
    stream: object
    like: object
    varlen: Varlen = None   # a packed batch of sequences (prepare_varlen), or None
    # score terms (with_score_terms): ALiBi's slopes, flattened (B H or H entries: alibi_stride
    # = H or 0 between batches) and the diagonal's shift; the attention sinks (H,); None: none
    alibi: object = None
    alibi_stride: int = 0
    alibi_shift: int = 0
    sinks: object = None
    # dropout on P (with_dropout): its probability and the Philox seed and offset of the call
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_offset: int = 0
    # score_mod / mask_mod (common/host/mods.py: with_mods): the call's ScoreMods and its aux views
    mods: object = None
    aux: tuple = ()
    block_mask: object = None   # a BlockMask of mods.mask_mod (fa2's forward)
    pages: Pages = None         # a packed batch's paged K/V (prepare_varlen's block_table)

    @property
    def element(self):
        """The 16-bit type the kernel computes with and writes (the output's): an Element."""
        return elements.element(self.out_dtype)

    @property
    def is_fp8(self):
        return self.dtype in FP8_DTYPES

    @property
    def view_batch(self):
        """The batch axis of the kernel views: `batch`, or 1 for a packed batch (varlen), whose
        sequences are rows of one."""
        return self.batch if self.varlen is None else 1

    @property
    def kv_group(self):
        return self.heads // self.heads_kv

    @property
    def banded(self):
        """Some key is masked by the band (causal or a window): the kernel's compile-time switch."""
        return self.band.banded

    @property
    def softcapped(self):
        return self.band.softcap > 0

    def mask_args(self):
        """The kernels' band and softcap arguments: lo, hi (int32), the cap on raw scores (fp32)."""
        return (np.int32(self.band.lo), np.int32(self.band.hi),
                np.float32(self.band.softcap_raw))

    def score_args(self):
        """The kernels' score-term arguments (fa2, fa3): ALiBi's slopes (flat fp32), their stride
        between batches (0: one per head) and the shift of its diagonal (the key a query's
        distance is counted from: N_k - N_q bottom-right, 0 top-left; a packed batch's kernel
        adds its sequence's), and the sinks (fp32, a head each); placeholders where absent."""
        alibi, sinks = self.alibi, self.sinks
        if alibi is None or sinks is None:
            empty = arrays.placeholder(self.library, 1, self.like, "float32")
            alibi = empty if alibi is None else alibi
            sinks = empty if sinks is None else sinks
        return alibi, np.int32(self.alibi_stride), np.int32(self.alibi_shift), sinks

    def dropout_args(self):
        """The kernels' dropout arguments (fa2's forward and backward kernels): the Philox seed and
        offset as 32-bit halves, the keep threshold, 1 / (1 - p) and the mask's column groups (of
        the longest key sequence: common/tile/dropout.py); zeros (never read) without dropout."""
        if not self.dropout_p:
            return _NO_DROPOUT
        n_k = self.n_k if self.varlen is None else self.varlen.max_k
        return dropout.rng_args(self.dropout_seed, self.dropout_offset, self.dropout_p) + \
            (np.int32(dropout.column_groups(n_k)),)

    def result(self):
        return self.o_out, self.lse_out

    def sequences(self):
        """A packed batch's sequences one at a time, for kernels that take one sequence a launch
        (standard): (first_q, n_q, first_k, n_k, problem) with problem the fixed-length problem of
        a batch of one over the sequence's rows of the packed views (no copy), its band at its
        own corner; None where the sequence has no query or no key (no kernel runs there).

        The most work (N_q x N_k) first: a launch costs the host more than a short sequence's
        kernels take, so issuing the long sequences first lets the host's launches for the short
        ones run while the long ones' kernels do (in the packed batch's order, the GPU would wait
        on the host for the short ones, then the host on the GPU for the long ones)."""
        seqs = self.varlen
        sq, sk = seqs.starts_q, seqs.starts_k
        work = [(sq[b + 1] - sq[b]) * (sk[b + 1] - sk[b]) for b in range(self.batch)]
        for b in sorted(range(self.batch), key=lambda b: -work[b]):
            first_q, first_k = seqs.starts_q[b], seqs.starts_k[b]
            n_q, n_k = seqs.starts_q[b + 1] - first_q, seqs.starts_k[b + 1] - first_k
            sub = None
            if n_q and n_k:
                shift = n_k - n_q if seqs.bottom_right else 0
                band = self.band
                if shift and (band.windowed or band.hi < masks.UNBOUNDED):
                    band = dataclasses.replace(
                        band, lo=band.lo + shift if band.windowed else band.lo,
                        hi=band.hi + shift if band.hi < masks.UNBOUNDED else band.hi)
                # a shallow copy with its own fields (dataclasses.replace re-runs __init__ over
                # every field: the host's time a sequence, and standard runs one a sequence)
                sub = copy.copy(self)
                sub.batch, sub.n_q, sub.n_k, sub.band, sub.varlen = 1, n_q, n_k, band, None
                sub.q = arrays.row_range(self.q, first_q, first_q + n_q)
                sub.k = arrays.row_range(self.k, first_k, first_k + n_k)
                sub.v = arrays.row_range(self.v, first_k, first_k + n_k)
                sub.o32 = arrays.row_range(self.o32, first_q, first_q + n_q)
                sub.lse = arrays.row_range(self.lse, first_q, first_q + n_q)
            yield first_q, n_q, first_k, n_k, sub

    def scratch(self, shape, dtype):
        """A work array in the caller's library (so its memory pool serves it)."""
        return arrays.empty(self.library, shape, dtype, like=self.like)

    def scratch_views(self, *specs):
        """New work arrays, one kernel view per (shape, element) in `specs`, from one allocation
        (arrays.empty_views)."""
        return arrays.empty_views(self.library, specs, like=self.like)


def prepare(q, k, v, *, causal, softmax_scale, out, head_dims, variant, dtypes=HALF_DTYPES,
            out_dtype=None, window_size=(-1, -1), softcap=0.0, align=masks.BOTTOM_RIGHT):
    """dtypes: the input types the variant takes; out_dtype: the output's ("float16" or
    "bfloat16"), None for q's (16-bit inputs). causal, window_size, softcap, align: the mask
    (common/tile/masks.py)."""
    if type(window_size) is not tuple:   # a list, say: checked, and hashable for the key
        window_size = masks.window_of(window_size)
    key = None
    if out is None:   # preallocated outputs take the checked path
        key = torch_call_key((q, k, v), (causal, softmax_scale, head_dims, variant, dtypes,
                                         out_dtype, window_size, softcap, align))
        template = _TEMPLATES.get(key) if key is not None else None
        if template is not None:
            prob = template.problem(q, k, v)
            if prob is not None:
                return prob
    prob = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out,
                    head_dims=head_dims, variant=variant, dtypes=dtypes, out_dtype=out_dtype,
                    window_size=window_size, softcap=softcap, align=align)
    if key is not None:
        remember(_TEMPLATES, key, _ForwardTemplate(prob))
    return prob


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal,
                   softmax_scale, out, head_dims, variant, window_size=(-1, -1), softcap=0.0,
                   align=masks.BOTTOM_RIGHT, block_table=None):
    """prepare for a packed batch of sequences, as flash_attn_varlen_func takes it: q (total_q,
    heads, d), k and v (total_k, heads_kv, d); cu_seqlens_q/k int32 (batch + 1,) device arrays of
    the sequences' first rows (0, then non-decreasing, ending at total); max_seqlen_q/k at least
    the longest sequence. The mask applies within each sequence (the causal diagonal at each
    sequence's bottom-right or top-left corner). o comes back (total_q, heads, d), lse (heads,
    total_q). cu_seqlens are read back to the host and checked (one small copy a call), unless
    their values were declared with `known_seqlens`. block_table (batch, max_pages) int32: k and v
    are a paged cache (num_pages, page_size, H_kv, d) instead, sequence b's keys (as many as
    cu_seqlens_k says) in its pages (`Pages`)."""
    if type(window_size) is not tuple:
        window_size = masks.window_of(window_size)
    dq, dk, dv = (arrays.describe(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    paged = block_table is not None
    for d, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        if paged and name != "q":
            if len(d.shape) != 4:
                raise ValueError(f"{name} must be a paged cache (num_pages, page_size, heads_kv, "
                                 f"head_dim) with a block_table, got shape {d.shape}")
        elif len(d.shape) != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) as in "
                             f"flash_attn_varlen_func, got shape {d.shape}")
    cu_q, batch, max_q, starts_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", dq.shape[0],
                                                     max_seqlen_q, "max_seqlen_q")
    cu_k, batch_k, max_k, starts_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k",
                                                       None if paged else dk.shape[0],
                                                       max_seqlen_k, "max_seqlen_k")
    if batch != batch_k:
        raise ValueError(f"cu_seqlens_q holds {batch} sequences but cu_seqlens_k {batch_k}")
    if batch > 65535:
        raise ValueError(f"at most 65535 sequences a call, got {batch}")
    pages, gk, gv = None, dk, dv
    if paged:   # checked as one page (a sequence of page_size rows): prepare's checks
        pages = _paged(block_table, dk, dv, batch, starts_k)
        gk, gv = (dataclasses.replace(x, shape=x.shape[1:], strides=x.strides[1:])
                  for x in (dk, dv))
    # q, k, v as one sequence of a batch of one: every check of prepare's
    _, total_q, h, total_k, h_kv, d = _check_geometry(
        *(_geometry(one_batch(x)) for x in (dq, gk, gv)), tuple(head_dims), variant)
    for x, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        _check_address(x, name)
    softmax_scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    # the band relative to each sequence's top-left corner; the kernels add N_k - N_q of their
    # sequence for the bottom-right diagonal
    corner = masks.TOP_LEFT if align == masks.BOTTOM_RIGHT else align   # (a bad align: its error)
    band = masks.band(causal, window_size, corner, max_q, max_k, softcap, softmax_scale)
    if out is None:
        o_out = arrays.empty(dq.library, (total_q, h, d), dq.dtype, like=q)
        lse_out = arrays.empty(dq.library, (h, total_q), "float32", like=q)
        do, dl = arrays.describe(o_out), arrays.describe(lse_out)
    else:
        o_out, lse_out = out
        do, dl = arrays.describe(o_out, "out[0] (o)"), arrays.describe(lse_out, "out[1] (lse)")
        if do.shape != dq.shape or do.dtype != dq.dtype:
            raise ValueError(f"out[0] must be {dq.dtype} of shape {dq.shape}, got {do.dtype} "
                             f"{do.shape}")
        if dl.shape != (h, total_q) or dl.dtype != "float32" or dl.strides[-1] != 4:
            raise ValueError(f"out[1] must be float32 of shape {(h, total_q)}, contiguous along "
                             f"its last axis, got {dl.dtype} {dl.shape}")
        _check_layout(one_batch(do), "out[0] (o)")
    return AttentionProblem(
        batch=batch, heads=h, heads_kv=h_kv, n_q=total_q, n_k=total_k, head_dim=d,
        dtype=dq.dtype, out_dtype=dq.dtype, causal=bool(causal), softmax_scale=softmax_scale,
        band=band,
        q=arrays.bits_view(one_batch(dq), np.uint16, _BSHD_TO_BHSD),
        k=arrays.bits_view(dk if paged else one_batch(dk), np.uint16, _BSHD_TO_BHSD),
        v=arrays.bits_view(dv if paged else one_batch(dv), np.uint16, _BSHD_TO_BHSD),
        o32=arrays.bits_view(one_batch(do), np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2),
        lse=arrays.bits_view(one_batch(dl), np.float32),
        o_out=o_out, lse_out=lse_out, library=dq.library, stream=arrays.stream_of(dq), like=q,
        varlen=Varlen(cu_q, cu_k, max_q, max_k, align == masks.BOTTOM_RIGHT, starts_q, starts_k),
        pages=pages)


def _paged(block_table, dk, dv, batch, starts_k):
    """The Pages of a packed batch over a paged cache, after checking the table (int32, a row a
    sequence, read back: every page a sequence reads is one of the cache's) and the caches (one
    shape, pages of a power of two keys, enough of them for each sequence)."""
    if dk.shape != dv.shape:
        raise ValueError(f"k and v (the paged cache) must have one shape, got {dk.shape} and "
                         f"{dv.shape}")
    n_pages, page_size = dk.shape[0], dk.shape[1]
    for x, name in ((dk, "k"), (dv, "v")):
        if n_pages > 1 and x.strides[0] % 16:
            raise ValueError(f"{name}: pages must start 16 bytes apart (its page stride is "
                             f"{x.strides[0]} bytes)")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"a paged cache's page_size (k.shape[1]) must be a power of two, got "
                         f"{page_size}")
    dt = arrays.describe(block_table, "block_table")
    if dt.dtype != "int32" or len(dt.shape) != 2 or dt.shape[0] != batch:
        raise ValueError(f"block_table must be int32 of shape ({batch}, max_pages), got "
                         f"{dt.dtype} {dt.shape}")
    lengths = np.diff(np.asarray(starts_k, dtype=np.int64))
    for b, n in enumerate(lengths):
        if -(-n // page_size) > dt.shape[1]:
            raise ValueError(f"sequence {b} has {n} keys but its block_table row holds "
                             f"{dt.shape[1]} pages of {page_size}")
    check_block_table(arrays.to_host(block_table), lengths, page_size, n_pages)
    return Pages(arrays.bits_view(dt, np.int32), page_size)


def check_block_table(table, lengths, page_size, pages):
    """Every page a sequence reads (its first ceil(length / page_size) entries of the host copy
    `table`) is a page of the cache, or the error naming the first that is not (the decode call's
    and the paged prefill's check)."""
    for b, n in enumerate(lengths):
        used = table[b, :(int(n) + page_size - 1) // page_size]
        bad = np.flatnonzero((used < 0) | (used >= pages))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"block_table[{b}, {j}] = {int(used[j])} is not a page of the cache "
                             f"(0 .. {pages - 1}); sequence {b} reads {len(used)} pages")


def with_score_terms(prob, alibi_slopes=None, sinks=None, align=masks.BOTTOM_RIGHT):
    """prob with its score terms checked and viewed for the kernels (score_args), in place:
    alibi_slopes, fp32 (H,) or (B, H) as flash_attn takes them, S[i, j] -= slope |i + shift - j|
    (shift: the band's diagonal, `align`); sinks, fp32 (H,), a logit of no value in each row's
    softmax (gpt-oss). Checked on every call (a few comparisons: the views are the call's)."""
    if alibi_slopes is None and sinks is None:
        return prob
    if prob.softmax_scale == 0:
        raise ValueError("alibi_slopes and sinks need softmax_scale != 0 (the kernels apply them "
                         "to raw scores, divided by the scale)")
    if alibi_slopes is not None:
        d = _score_vector(prob, alibi_slopes, "alibi_slopes", ((prob.heads,),
                                                               (prob.batch, prob.heads)))
        prob.alibi = arrays.bits_view(d, np.float32)
        prob.alibi_stride = prob.heads if d.shape[0] > prob.heads else 0   # (B, H), or one a head
        if prob.varlen is None and align == masks.BOTTOM_RIGHT:
            prob.alibi_shift = prob.n_k - prob.n_q
    if sinks is not None:
        prob.sinks = arrays.bits_view(_score_vector(prob, sinks, "sinks", ((prob.heads,),)),
                                      np.float32)
    return prob


_NO_DROPOUT = (np.uint32(0),) * 5 + (np.float32(1), np.int32(0))


def with_dropout(prob, dropout_p=0.0, seed=0, offset=0, variant="fa2"):
    """prob with dropout on P (probability dropout_p, 0 <= p < 1) drawn from Philox with this
    seed and offset (common/tile/dropout.py; the same three give the same mask, forward and
    backward), checked, in place."""
    if not dropout_p:
        return prob
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    for name, value in (("dropout_seed", seed), ("dropout_offset", offset)):
        if not isinstance(value, (int, np.integer)) or not 0 <= int(value) < 1 << 64:
            raise ValueError(f"{name} must be an integer in [0, 2^64), got {value!r}")
    if prob.is_fp8:
        raise ValueError(f"{variant}: dropout takes 16-bit inputs, not FP8")
    n_q, n_k = (prob.n_q, prob.n_k) if prob.varlen is None else \
        (prob.varlen.max_q, prob.varlen.max_k)
    dropout.check_groups(n_q, n_k)
    prob.dropout_p, prob.dropout_seed, prob.dropout_offset = float(dropout_p), int(seed), int(offset)
    return prob


def _score_vector(prob, x, name, shapes):
    """A described fp32 array of one of `shapes`, contiguous, as one flat vector; a 2-D one whose
    rows are one row broadcast (stride 0, torch's expand: flash_attn takes it) as that row."""
    d = arrays.describe(x, name)
    if d.library != prob.library:
        raise TypeError(f"{name} is a {d.library} array but q is {prob.library}")
    if d.dtype == "float32" and len(d.shape) == 2 and tuple(d.shape) in shapes and \
            tuple(d.strides) == (0, 4):
        return dataclasses.replace(d, shape=(d.shape[1],), strides=(4,))
    if d.dtype != "float32" or tuple(d.shape) not in shapes or \
            tuple(d.strides) != arrays.contiguous_strides(d.shape, 4):
        raise ValueError(f"{name} must be a contiguous float32 array of shape "
                         f"{' or '.join(map(str, shapes))}, got {d.dtype} of shape {d.shape}")
    n = math.prod(d.shape)
    return dataclasses.replace(d, shape=(n,), strides=(4,))


_KNOWN_SEQLENS = {}   # id(tensor) -> (weak reference, version, its values as int64 NumPy)


def version_of(tensor):
    """A torch tensor's version counter (it moves at every in-place write), or None for one that
    keeps none (an inference tensor)."""
    try:
        return tensor._version
    except RuntimeError:   # "Inference tensors do not track version counter"
        return None


def known_seqlens(cu, values):
    """Declare what torch tensor `cu` (cu_seqlens a caller made on the device from values it
    holds on the host) contains, so that prepare_varlen checks `values` instead of reading `cu`
    back: no host synchronisation a call. Kept while the tensor lives and is not written in
    place (torch's version counter); for a packed batch that many calls share, e.g. every layer
    of a model's forward (variants/integrations/transformers.py). An inference tensor (made
    under torch.inference_mode) keeps no version counter: nothing is declared, it is read back."""
    key = id(cu)
    if version_of(cu) is None:
        return cu

    def forget(ref):
        if _KNOWN_SEQLENS.get(key, (None,))[0] is ref:
            del _KNOWN_SEQLENS[key]
    _KNOWN_SEQLENS[key] = (weakref.ref(cu, forget), version_of(cu),
                           np.asarray(values, dtype=np.int64))
    return cu


def one_batch(d):
    """A described array with a leading axis of one (a batch of one)."""
    return dataclasses.replace(d, shape=(1,) + tuple(d.shape),
                               strides=(d.shape[0] * d.strides[0],) + tuple(d.strides))


def _check_cu_seqlens(cu, name, total, max_seqlen, max_name):
    """(the int32 kernel view of cu_seqlens, the number of sequences, max_seqlen, cu_seqlens on the
    host as a tuple of ints) after checking
    that cu is 0, then non-decreasing, ending at `total`, and that no sequence is longer than
    max_seqlen; or the error that names the problem."""
    d = arrays.describe(cu, name)
    if d.dtype != "int32" or len(d.shape) != 1 or d.shape[0] < 2 or d.strides[0] != 4:
        raise ValueError(f"{name} must be a contiguous int32 array of batch + 1 >= 2 sequence "
                         f"starts, got {d.dtype} of shape {d.shape}")
    host = _KNOWN_SEQLENS.get(id(cu), (None,))
    if host[0] is not None and host[0]() is cu and host[1] == version_of(cu):
        host = host[2]
    else:
        host = arrays.to_host(cu).astype(np.int64)
    lengths = np.diff(host)
    if host[0] != 0 or (lengths < 0).any() or (total is not None and host[-1] != total):
        ends = "" if total is None else f" and end at the {total} rows of its tensor"
        raise ValueError(f"{name} must start at 0{',' if ends else ' and'} never decrease{ends}, "
                         f"got {host.tolist() if host.size <= 16 else host}")
    longest = int(lengths.max())
    if int(max_seqlen) < longest:
        raise ValueError(f"{max_name}={max_seqlen} is below the longest sequence, {longest}")
    return arrays.bits_view(d, np.int32), len(lengths), int(max_seqlen), \
        tuple(int(x) for x in host)


# --------------------------------------------------------------------------- the per-call path
# A training step calls with the same geometry every time, and checking and describing the
# arguments costs more than the launch (issue: host overhead). So the first call with a geometry
# (every input's shape, strides, dtype and device, and the call's options) runs every check and
# keeps what it found as a template; later calls with the same key read the addresses, check
# their alignment, allocate the outputs and read the current stream, nothing else. Keys are made
# for torch tensors (the autograd path; other libraries take the checked path, whose checks are
# cached too, see _check_geometry); a call whose key has no template, or whose addresses are
# misaligned, takes the checked path, so it raises exactly the error it always raised.

_TEMPLATES = {}


def torch_call_key(tensors, options):
    """The call's key when every array is a torch tensor (None otherwise): each one's shape,
    strides, dtype and device, then `options`."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensor = torch.Tensor
    key = [options]
    for x in tensors:
        if not isinstance(x, tensor):
            return None
        key.append((x.shape, x.stride(), x.dtype, x.device))
    return tuple(key)


def remember(cache, key, value, size=256):
    """cache[key] = value, the oldest entry dropped past `size` entries."""
    if len(cache) >= size:
        try:
            cache.pop(next(iter(cache)), None)
        except RuntimeError:   # another thread (autograd's) changed the cache meanwhile
            pass
    cache[key] = value


def misaligned(*ptrs):
    """True if any address is not a multiple of 16 bytes."""
    bits = 0
    for p in ptrs:
        bits |= p
    return bool(bits & 15)


_PER_CALL = ("q", "k", "v", "o32", "lse", "o_out", "lse_out", "stream", "like")


class ProblemTemplate:
    """An AttentionProblem of torch tensors without its addresses, outputs and stream: what the
    checks found for one geometry (the first call's arrays are not kept: a template must not hold
    memory alive)."""
    VIEWS = ("q", "k", "v", "o32", "lse")

    def __init__(self, prob):
        self.fields = {f: (None if f in _PER_CALL else x) for f, x in vars(prob).items()}
        self.layouts = tuple(getattr(prob, f).layout for f in self.VIEWS)
        self.device = prob.o_out.device

    def problem(self, ptrs, q, k, v, o, lse):
        """The problem over q, k, v, o, lse at `ptrs` (their data pointers, in that order)."""
        over = KernelView.over
        lq, lk, lv, lo, ll = self.layouts
        prob = AttentionProblem.__new__(AttentionProblem)
        prob.__dict__.update(self.fields)
        prob.q, prob.k, prob.v = over(ptrs[0], lq, q), over(ptrs[1], lk, k), over(ptrs[2], lv, v)
        prob.o32, prob.lse = over(ptrs[3], lo, o), over(ptrs[4], ll, lse)
        prob.o_out, prob.lse_out, prob.like = o, lse, q
        prob.stream = arrays.torch_stream(self.device.index)
        return prob


class _ForwardTemplate(ProblemTemplate):
    """A forward call's template: the problem, with o and lse allocated a call."""

    def __init__(self, prob):
        import torch
        super().__init__(prob)
        self.out_shapes = (tuple(prob.o_out.shape), tuple(prob.lse_out.shape))
        self.out_dtype = getattr(torch, prob.out_dtype)

    def problem(self, q, k, v):
        """The problem of a call with this template's key (None: an address is misaligned)."""
        import torch
        pq, pk, pv = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if misaligned(pq, pk, pv):
            return None
        o = torch.empty(self.out_shapes[0], dtype=self.out_dtype, device=self.device)
        lse = torch.empty(self.out_shapes[1], dtype=torch.float32, device=self.device)
        return super().problem((pq, pk, pv, o.data_ptr(), lse.data_ptr()), q, k, v, o, lse)


def _prepare(q, k, v, *, causal, softmax_scale, out, head_dims, variant, dtypes, out_dtype,
             window_size, softcap, align):
    """prepare's checked path: every check, with errors that name the problem."""
    dq, dk, dv = (arrays.describe(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    # Everything but the addresses is checked once per (shapes, strides, dtypes, options): a
    # training step calls with the same geometry every time, and the checks cost more than the
    # launch (issue: host overhead).
    b, n_q, h, n_k, h_kv, d = _check_geometry(_geometry(dq), _geometry(dk), _geometry(dv),
                                              tuple(head_dims), variant, dtypes)
    out_dtype = dq.dtype if out_dtype is None else out_dtype
    if out_dtype not in HALF_DTYPES:
        raise TypeError(f"the output is float16 or bfloat16, not {out_dtype}")
    element = np.uint16 if dq.itemsize == 2 else np.uint8
    for x, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        _check_address(x, name)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    band = masks.band(causal, window_size, align, n_q, n_k, softcap, softmax_scale)

    if out is None:   # contiguous, of the right shape and dtype by construction
        o_out = arrays.empty(dq.library, (b, n_q, h, d), out_dtype, like=q)
        lse_out = arrays.empty(dq.library, (b, h, n_q), "float32", like=q)
        do, dl = arrays.describe(o_out), arrays.describe(lse_out)
    else:
        o_out, lse_out = out
        do, dl = arrays.describe(o_out, "out[0] (o)"), arrays.describe(lse_out, "out[1] (lse)")
        if do.shape != dq.shape or do.dtype != out_dtype:
            raise ValueError(f"out[0] must be {out_dtype} of shape {dq.shape}, got {do.dtype} "
                             f"{do.shape}")
        if dl.shape != (b, h, n_q) or dl.dtype != "float32":
            raise ValueError(f"out[1] must be float32 of shape {(b, h, n_q)}, got {dl.dtype} "
                             f"{dl.shape}")
        _check_layout(do, "out[0] (o)")
        if dl.strides[-1] != 4:
            raise ValueError("out[1] (lse) must be contiguous along its last axis")

    return AttentionProblem(
        batch=b, heads=h, heads_kv=h_kv, n_q=n_q, n_k=n_k, head_dim=d, dtype=dq.dtype,
        out_dtype=out_dtype, causal=bool(causal), softmax_scale=softmax_scale, band=band,
        q=arrays.bits_view(dq, element, _BSHD_TO_BHSD),
        k=arrays.bits_view(dk, element, _BSHD_TO_BHSD),
        v=arrays.bits_view(dv, element, _BSHD_TO_BHSD),
        o32=arrays.bits_view(do, np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2),
        lse=arrays.bits_view(dl, np.float32),
        o_out=o_out, lse_out=lse_out, library=dq.library, stream=arrays.stream_of(dq), like=q)


def _geometry(d):
    """What the checks of one input depend on (all but its address)."""
    return d.library, d.shape, d.strides, d.dtype, d.itemsize


@lru_cache(maxsize=1024)
def _check_geometry(gq, gk, gv, head_dims, variant, dtypes=HALF_DTYPES):
    """(batch, n_q, heads, n_k, heads_kv, head_dim) of valid q, k, v geometries (see _geometry),
    or the error that names what is wrong; exceptions are not cached, so a bad call always
    raises."""
    for g, name in ((gq, "q"), (gk, "k"), (gv, "v")):
        if len(g[1]) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim) as in "
                             f"flash_attn_func, got shape {g[1]}")
        if g[3] not in dtypes:
            raise TypeError(f"{name} has dtype {g[3]}; {variant} takes {' or '.join(dtypes)}")
    if not gq[3] == gk[3] == gv[3]:
        raise TypeError(f"q, k, v must share one dtype, got {gq[3]}, {gk[3]}, {gv[3]}")
    if len({gq[0], gk[0], gv[0]}) != 1:
        raise TypeError(f"q, k, v come from different array libraries "
                        f"({gq[0]}, {gk[0]}, {gv[0]})")
    (b, n_q, h, d), (bk, n_k, h_kv, dk_) = gq[1], gk[1]
    if gk[1] != gv[1]:
        raise ValueError(f"k and v must have the same shape, got {gk[1]} and {gv[1]}")
    if bk != b:
        raise ValueError(f"q has batch {b} but k, v have batch {bk}")
    if dk_ != d:
        raise ValueError(f"q has head_dim {d} but k, v have head_dim {dk_}")
    if min(b, n_q, h, n_k, h_kv) < 1:
        raise ValueError(f"empty problem: q {gq[1]}, k {gk[1]}")
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of the {h_kv} heads of k, v")
    tiles.check_head_dim(d, variant, head_dims)
    if max(b, h) > 65535:
        raise ValueError(f"batch and heads must each be at most 65535, got {b} and {h}")
    for g, name in ((gq, "q"), (gk, "k"), (gv, "v")):
        _check_strides(g[1], g[2], g[4], name)
    return b, n_q, h, n_k, h_kv, d


def _check_layout(d, name):
    """A described array's strides and address, as the kernels need them."""
    _check_strides(d.shape, d.strides, d.itemsize, name)
    _check_address(d, name)


def _check_strides(shape, strides, itemsize, name):
    """The kernels move 16-byte chunks of rows: the head_dim axis must be contiguous and every
    row start 16-byte aligned (for the addresses: _check_address)."""
    if strides[3] != itemsize:
        raise ValueError(f"{name} must be contiguous along head_dim (stride {strides[3]} bytes); "
                         "make it contiguous first")
    if any(s % 16 for s, n in zip(strides[:3], shape[:3]) if n > 1):
        raise ValueError(f"{name} rows must start at 16-byte boundaries (strides {strides} bytes); "
                         "make it contiguous first")


def _check_address(d, name):
    if d.ptr % 16:
        raise ValueError(f"{name} rows must start at 16-byte boundaries (address {d.ptr:#x}); "
                         "make it contiguous first")
