"""What every variant's backward pass shares: checking its inputs, D = rowsum(dO o O), and dQ's fp32
accumulator.

FA2 Algorithm 2 (and FA1 Algorithm 4) take the forward's O and L = LSE with dO and return dQ, dK,
dV. Around the variant's own kernels:
  preprocess   D_i = rowsum(dO_i o O_i) (fp32, one warp a row: FA2 Alg. 2 l.4), and dQ's fp32
               accumulator set to 0 when the variant adds into it (atomics or read-modify-write);
  convert_dq   dQ = softmax_scale * accumulator, rounded to the input dtype, in q's layout;
  sink_grad    with attention sinks (gpt-oss), d s_h = -sum_i exp(s_h - L_i) D_i over head h's
               rows: the sink's share of each row times its D (a sink has no value, so its dP is 0).
The accumulator is (B, H, rows, d') fp32, row-major, or, for a kernel that adds whole query blocks
with bulk reductions, one contiguous block of B_r x d' floats per query block in that kernel's
fragment order (`DqLayout`, rows padded to whole blocks); d' = tiles.tile_columns(d), the kernels'
tile width (d itself when a multiple of 16; the columns past d stay 0 and are not converted).
`prepare_backward` validates everything with errors that name the problem and returns the views.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32

from common.hardware import ptx
from common.hardware.target import kernel
from common.host import arrays
from common.host.launching import KernelView, launch
from common.host.problem import (
    _BSHD_TO_BHSD,
    AttentionProblem,
    ProblemTemplate,
    _check_layout,
    misaligned,
    one_batch,
    prepare,
    prepare_varlen,
    remember,
    torch_call_key,
)
from common.tile import masks, tiles

WARPS = 4            # rows per thread block of the row kernels (one warp a row)


@dataclass
class BackwardProblem:
    """One backward call: the forward's problem (q, k, v, o, lse views) and the gradients'."""
    prob: AttentionProblem
    do: object          # (B, H, N_q, d) uint16 view of dO
    do32: object        # (B, H, N_q, d/2) uint32 view of dO
    dq_out: object
    dk_out: object
    dv_out: object
    dq32: object        # (B, H, N_q, d/2) uint32 views of the outputs
    dk32: object        # (B, H_kv, N_k, d/2)
    dv32: object
    d_vec: object = None     # (B, H, N_q) fp32: D = rowsum(dO o O)
    dq_acc: object = None    # (B, H, N_q or padded, d) fp32: dQ / softmax_scale, accumulated
    dq_layout: object = None     # None: dq_acc row-major; a DqLayout: in fragment order

    def result(self):
        return self.dq_out, self.dk_out, self.dv_out


def prepare_backward(do, q, k, v, o, lse, *, causal, softmax_scale, head_dims, variant, grads=None,
                     window_size=(-1, -1), softcap=0.0, align=masks.BOTTOM_RIGHT):
    """Check a backward call's arguments (q, k, v, o, lse as the forward took and returned them; dO
    like o; the forward's mask: causal, window_size, softcap, align) and allocate (or check) dq,
    dk, dv shaped like q, k, v. Like `prepare`, a call with the geometry of an earlier one (torch
    tensors) only reads addresses and allocates."""
    key = None
    if type(window_size) is not tuple:
        window_size = masks.window_of(window_size)
    if grads is None:
        key = torch_call_key((do, q, k, v, o, lse), (causal, softmax_scale, head_dims, variant,
                                                     window_size, softcap, align))
        template = _TEMPLATES.get(key) if key is not None else None
        if template is not None:
            g = template.problem(do, q, k, v, o, lse)
            if g is not None:
                return g
    g = _prepare_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                          head_dims=head_dims, variant=variant, grads=grads,
                          window_size=window_size, softcap=softcap, align=align)
    if key is not None:
        remember(_TEMPLATES, key, _BackwardTemplate(g))
    return g


def prepare_backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, *, causal, softmax_scale, head_dims, variant, grads=None,
                            window_size=(-1, -1), softcap=0.0, align=masks.BOTTOM_RIGHT):
    """prepare_backward for a packed batch (common.host.problem.prepare_varlen): q, o, do (total_q,
    heads, d), k, v (total_k, heads_kv, d), lse (heads, total_q); dq, dk, dv like q, k, v."""
    prob = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal=causal, softmax_scale=softmax_scale, out=(o, lse),
                          head_dims=head_dims, variant=variant, window_size=window_size,
                          softcap=softcap, align=align)
    return _gradient_views(prob, do, q, k, v, grads, one_batch)


_TEMPLATES = {}


class _BackwardTemplate:
    """A BackwardProblem of torch tensors without its addresses, gradients and stream (see
    common.host.problem's per-call path): the forward problem's template and the gradients' layouts."""

    def __init__(self, g):
        import torch
        self.forward = ProblemTemplate(g.prob)
        self.layouts = tuple(getattr(g, f).layout for f in ("do", "do32", "dq32", "dk32", "dv32"))
        self.grad_shapes = tuple(tuple(x.shape) for x in g.result())
        self.dtype, self.device = getattr(torch, g.prob.dtype), g.dq_out.device

    def problem(self, do, q, k, v, o, lse):
        """The problem of a call with this template's key (None: an address is misaligned)."""
        import torch
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                do.data_ptr())
        if misaligned(*ptrs):
            return None
        dq, dk, dv = (torch.empty(shape, dtype=self.dtype, device=self.device)
                      for shape in self.grad_shapes)
        ldo, ldo32, ldq, ldk, ldv = self.layouts
        over = KernelView.over
        return BackwardProblem(
            prob=self.forward.problem(ptrs, q, k, v, o, lse), do=over(ptrs[5], ldo, do),
            do32=over(ptrs[5], ldo32, do), dq_out=dq, dk_out=dk, dv_out=dv,
            dq32=over(dq.data_ptr(), ldq, dq), dk32=over(dk.data_ptr(), ldk, dk),
            dv32=over(dv.data_ptr(), ldv, dv))


def _prepare_backward(do, q, k, v, o, lse, *, causal, softmax_scale, head_dims, variant, grads,
                      window_size, softcap, align):
    """prepare_backward's checked path."""
    prob = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, out=(o, lse),
                   head_dims=head_dims, variant=variant, window_size=window_size,
                   softcap=softcap, align=align)
    return _gradient_views(prob, do, q, k, v, grads, lambda d: d)


def _gradient_views(prob, do, q, k, v, grads, as_batch):
    """The BackwardProblem of a checked forward problem: dO checked like q, the gradients
    allocated (or checked) like q, k, v; as_batch gives a described array its batch axis (a
    packed batch: one)."""
    d_do, d_q = arrays.describe(do, "do"), arrays.describe(q, "q")
    if d_do.shape != d_q.shape or d_do.dtype != d_q.dtype:
        raise ValueError(f"do must be {d_q.dtype} of shape {d_q.shape} (like q and o), got "
                         f"{d_do.dtype} {d_do.shape}")
    if d_do.library != d_q.library:
        raise TypeError(f"do is a {d_do.library} array but q is {d_q.library}")
    _check_layout(as_batch(d_do), "do")
    shapes = {"dq": d_q.shape, "dk": arrays.describe(k).shape, "dv": arrays.describe(v).shape}
    if grads is None:
        grads = tuple(arrays.empty(prob.library, shape, prob.dtype, like=q)
                      for shape in shapes.values())
    views = []
    for g, (name, shape) in zip(grads, shapes.items()):
        d_g = arrays.describe(g, name)
        if d_g.shape != shape or d_g.dtype != prob.dtype:
            raise ValueError(f"{name} must be {prob.dtype} of shape {shape}, got {d_g.dtype} "
                             f"{d_g.shape}")
        d_g = as_batch(d_g)
        _check_layout(d_g, name)
        views.append(arrays.bits_view(d_g, np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2))
    d_do = as_batch(d_do)
    return BackwardProblem(
        prob=prob, do=arrays.bits_view(d_do, np.uint16, _BSHD_TO_BHSD),
        do32=arrays.bits_view(d_do, np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2),
        dq_out=grads[0], dk_out=grads[1], dv_out=grads[2],
        dq32=views[0], dk32=views[1], dv32=views[2])


@dataclass(frozen=True)
class DqLayout:
    """dQ's accumulator in fragment order (tiles.stage_accumulator_fragments_f32): each query block
    of `rows` x `cols` floats is contiguous, as `threads` threads staged it, their warps in a grid
    of (warps / warps_across) x warps_across tiles of dQ_i, each warp holding (M, n_tiles, 4) fp32
    registers of its warp_rows x warp_cols tile. Warp w's terms are the block's w-th slice of
    warp_floats floats (lane l's tile k at floats 4 (32 k + l) of it), so that each warp adds its
    own slice with its own bulk reduction."""
    rows: int
    cols: int
    threads: int
    warps_across: int

    @property
    def warp_cols(self):
        return self.cols // self.warps_across

    @property
    def warp_rows(self):
        return self.rows * self.warps_across // (self.threads // 32)

    @property
    def n_tiles(self):      # n8 tiles across a warp's columns
        return self.warp_cols // 8

    @property
    def warp_floats(self):  # one warp's slice of a query block
        return self.rows * self.cols // (self.threads // 32)

    def padded_rows(self, n):
        return (n + self.rows - 1) // self.rows * self.rows


# --------------------------------------------------------------------------- the row kernels

@lru_cache(maxsize=None)
def build_preprocess(head_dim, element, zero_dq, dq_cols):
    """D = rowsum(dO o O) in fp32 (and, when zero_dq, rows < n_acc of dQ's accumulator set to 0:
    n_acc >= n_q covers an accumulator padded to whole query blocks, its rows dq_cols wide)."""
    WORDS, D, ZERO_DQ, ELEM = head_dim // 2, dq_cols, zero_dq, element.code

    @kernel
    def preprocess(o32, do32, d_vec, dq_acc, n_q, n_acc):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        row = cuda.blockIdx.x * WARPS + warp
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        inside = row < n_q
        r = row if inside else 0      # rows past n_q still take part in the shuffles
        acc = float32(0)
        for w in range(lane, WORDS, 32):
            o0, o1 = tiles.unpack_pair(o32[b, h, r, w], ELEM)
            g0, g1 = tiles.unpack_pair(do32[b, h, r, w], ELEM)
            acc += o0 * g0 + o1 * g1
        for offset in (16, 8, 4, 2, 1):
            acc += ptx.shfl_xor_f32(acc, offset)
        if inside and lane == 0:
            d_vec[b, h, row] = acc
        if ZERO_DQ and row < n_acc:
            for c in range(lane, D, 32):
                dq_acc[b, h, row, c] = float32(0)

    return preprocess


@lru_cache(maxsize=None)
def build_convert_dq(head_dim, element):
    """dQ = softmax_scale * accumulator, rounded to the 16-bit dtype, 4 bytes a lane a step."""
    WORDS, ELEM = head_dim // 2, element.code

    @kernel
    def convert_dq(dq_acc, dq32, n_q, softmax_scale):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        row = cuda.blockIdx.x * WARPS + warp
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        if row < n_q:
            for w in range(lane, WORDS, 32):
                dq32[b, h, row, w] = tiles.pack_pair(dq_acc[b, h, row, 2 * w] * softmax_scale,
                                                     dq_acc[b, h, row, 2 * w + 1] * softmax_scale,
                                                     ELEM)

    return convert_dq


@lru_cache(maxsize=None)
def build_convert_dq_fragments(layout, element, head_dim):
    """convert_dq for an accumulator in fragment order (DqLayout). A thread takes one 16-byte unit:
    the registers c0..c3 of one m16n8 tile of one staging thread, i.e. columns (col, col + 1) of
    rows r and r + 8. Threads are mapped to units so that a warp's 32 lanes cover the 32 column
    pairs of one staged row (n-tile = lane / 4, t = lane % 4): each of its two stores writes 128
    contiguous bytes of dQ and each load reads whole 64-byte runs of the accumulator. Columns at or
    past head_dim (a tile's zero columns, layout.cols > head_dim) are not stored."""
    D, ELEM, ROWS = layout.cols, element.code, layout.rows
    PADDED, DV = layout.cols > head_dim, head_dim
    PAIRS = 4 * layout.n_tiles                     # column pairs a staged row of one warp
    MQ, WARPS_ = layout.warp_rows // 16, layout.threads // 32
    N_TILES, ACROSS = layout.n_tiles, layout.warps_across
    WARP_ROWS, WARP_COLS, WARP_FLOATS = layout.warp_rows, layout.warp_cols, layout.warp_floats

    @kernel
    def convert_dq_fragments(dq_acc, dq32, n_q, softmax_scale):
        u = cuda.blockIdx.x * (32 * WARPS) + int32(cuda.threadIdx.x)
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        pair, seg = u % PAIRS, u // PAIRS             # seg: (query block, warp, m, g)
        n, t = pair >> 2, pair & 3
        g, m = seg & 7, (seg >> 3) % MQ
        warp, block = (seg >> 3) // MQ % WARPS_, (seg >> 3) // MQ // WARPS_
        row = block * ROWS + (warp // ACROSS) * WARP_ROWS + 16 * m + g
        col = (warp % ACROSS) * WARP_COLS + 8 * n + 2 * t
        # Where the staging thread (warp, lane 4g + t) put acc[m, n, 0:4]:
        f = warp * WARP_FLOATS + 4 * (32 * (m * N_TILES + n) + 4 * g + t)
        at_row, at_col = block * ROWS + f // D, f % D
        if PADDED and col >= DV:
            return
        if row < n_q:
            dq32[b, h, row, col >> 1] = tiles.pack_pair(
                dq_acc[b, h, at_row, at_col] * softmax_scale,
                dq_acc[b, h, at_row, at_col + 1] * softmax_scale, ELEM)
        if row + 8 < n_q:
            dq32[b, h, row + 8, col >> 1] = tiles.pack_pair(
                dq_acc[b, h, at_row, at_col + 2] * softmax_scale,
                dq_acc[b, h, at_row, at_col + 3] * softmax_scale, ELEM)

    return convert_dq_fragments


SINK_THREADS = 256


@lru_cache(maxsize=None)
def build_sink_grad():
    """d s_h = -sum over batches and rows of exp(s_h - L) D, one thread block a head, summed in a
    fixed order (bitwise reproducible)."""
    WARPS_ = SINK_THREADS // 32

    @kernel
    def sink_grad(lse, d_vec, sinks, dsinks, n_q):
        tid = int32(cuda.threadIdx.x)
        h = cuda.blockIdx.x
        sink = sinks[h]
        acc = float32(0)
        for b in range(lse.shape[0]):
            for r in range(tid, n_q, SINK_THREADS):
                acc += math.exp(sink - lse[b, h, r]) * d_vec[b, h, r]
        for offset in (16, 8, 4, 2, 1):
            acc += ptx.shfl_xor_f32(acc, offset)
        part = cuda.shared.array(WARPS_, float32)
        if tid & 31 == 0:
            part[tid >> 5] = acc
        cuda.syncthreads()
        if tid == 0:
            total = float32(0)
            for w in range(WARPS_):
                total += part[w]
            dsinks[h] = -total

    return sink_grad


def sink_grad(g):
    """d sinks (H,) fp32, in q's library, after `preprocess` (it reads D)."""
    prob = g.prob
    dsinks = arrays.empty(prob.library, (prob.heads,), "float32", like=prob.like)
    launch(build_sink_grad(), (prob.heads,), SINK_THREADS, 0, prob.stream, prob.lse, g.d_vec,
           prob.sinks, arrays.bits_view(arrays.describe(dsinks), np.float32), np.int32(prob.n_q))
    return dsinks


def _row_grid(prob, rows=None):
    return (((rows or prob.n_q) + WARPS - 1) // WARPS, prob.view_batch, prob.heads)


def preprocess(g, zero_dq, dq_layout=None):
    """Fill g.d_vec (allocating it) and, when zero_dq, a zeroed g.dq_acc: row-major, or in
    `dq_layout`'s fragment order (rows padded to whole query blocks)."""
    prob = g.prob
    rows = dq_layout.padded_rows(prob.n_q) if dq_layout is not None else prob.n_q
    # a row of the accumulator: the tile's columns (fa3's backward: whole 64-column panels)
    cols = dq_layout.cols if dq_layout is not None else tiles.tile_columns(prob.head_dim)
    shape = (prob.view_batch, prob.heads, rows, cols) if zero_dq else (1, 1, 1, 1)
    g.d_vec, g.dq_acc = prob.scratch_views(          # dq_acc (1, 1, 1, 1): not used, one signature
        ((prob.view_batch, prob.heads, prob.n_q), np.float32), (shape, np.float32))
    g.dq_layout = dq_layout
    launch(build_preprocess(prob.head_dim, prob.element, bool(zero_dq), cols), _row_grid(prob, rows),
           32 * WARPS, 0, prob.stream, prob.o32, g.do32, g.d_vec, g.dq_acc, np.int32(prob.n_q),
           np.int32(rows if zero_dq else 0))


def convert_dq(g):
    """g.dq_out <- softmax_scale * g.dq_acc in the input dtype."""
    prob = g.prob
    args = (g.dq_acc, g.dq32, np.int32(prob.n_q), np.float32(prob.softmax_scale))
    if g.dq_layout is None:
        launch(build_convert_dq(prob.head_dim, prob.element), _row_grid(prob), 32 * WARPS, 0,
               prob.stream, *args)
    else:
        units = g.dq_layout.padded_rows(prob.n_q) * g.dq_layout.cols // 4
        grid = ((units + 32 * WARPS - 1) // (32 * WARPS), prob.view_batch, prob.heads)
        launch(build_convert_dq_fragments(g.dq_layout, prob.element, prob.head_dim), grid,
               32 * WARPS, 0, prob.stream, *args)


def compile_targets():
    """(name, kernel, argument types, mma count) of the row kernels, bf16."""
    from numba import types

    from common.hardware.elements import BFLOAT16
    from common.host.problem import LSE_TYPE, OUT_TYPE
    f32_4 = types.Array(types.float32, 4, "C")
    for head_dim in (64, 128):
        yield f"backward preprocess d={head_dim} bf16", build_preprocess(head_dim, BFLOAT16, True,
                                                                             head_dim), \
            (OUT_TYPE, OUT_TYPE, LSE_TYPE, f32_4, types.int32, types.int32), 0
        yield f"backward convert_dq d={head_dim} bf16", build_convert_dq(head_dim, BFLOAT16), \
            (f32_4, OUT_TYPE, types.int32, types.float32), 0
    f32 = types.Array(types.float32, 1, "C")
    yield "backward sink_grad", build_sink_grad(), (LSE_TYPE, LSE_TYPE, f32, f32, types.int32), 0
