"""Context parallelism: one sequence split across GPUs, attention exact by ring passing of K/V.

    import variants.context_parallel as cp
    q_local = cp.shard(q, rank, world, layout="zigzag")        # (B, N / world, H, d) on this GPU
    o_local = cp.attention(q_local, k_local, v_local, variant="fa2", causal=True)

Ring attention (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers"): each of
the W ranks of a process group holds a contiguous part of the sequence's queries, keys and values.
The K/V parts travel once around the ring (rank r sends to r + 1 and receives from r - 1), so at
step s rank r holds the keys of rank src = r - s, and attends its queries to them with any
registered variant's kernel. Each step yields a partial output O_s and log-sum-exp L_s over
disjoint keys, and these merge exactly, as the splits of Flash-Decoding do:

    L = log(e^L + e^L_s),   O = e^(L_old - L) O + e^(L_s - L) O_s              (merge)

The transfer of step s + 1's K/V is started before step s's kernel runs (torch.distributed's
batch_isend_irecv: NCCL's own stream) and waited on after it, so the communication hides behind
the kernel when a step's FLOPs take longer than its bytes (`overlap=False`, the ablation, waits
before the kernel).

The backward runs the ring again: K/V travel as in the forward, and with them the running sums of
dK and dV (float32) for the keys they belong to; after W steps each rank's dK, dV arrive back at
the rank that owns those keys. Each step is the variant's own backward on the step's block, given
the *final* O and L of the forward: P = exp(S - L) is then the block of the full softmax, and
D = rowsum(dO o O) the full row's, so the block's dQ, dK, dV are exact contributions.

Causal attention and load balance (`layout`): with contiguous parts, rank r's queries see only
ranks 0..r's keys, so rank 0 works one step in W and rank W - 1 every step. The zig-zag layout
(Llama 3's context parallelism, "The Llama 3 Herd of Models" 2024, sec. 3.3.2; ring-flash-attention's
zigzag ring) cuts the sequence into 2W chunks and gives rank r chunks r and 2W - 1 - r: then every
step after the first costs every rank the same half block (`step_block`). (Striped Attention,
Brandon et al. 2023, balances the same way with a round-robin split of the tokens.)

The ring itself is any object with `rank`, `world` and `exchange(tensors)`, which starts sending
`tensors` to rank + 1 and receiving tensors of the same shapes from rank - 1, and returns a handle
whose `wait()` gives the received ones. `TorchRing` is torch.distributed's (NCCL or gloo); the tests
drive the same loops with an in-process ring of threads.
"""
import math
import time
from dataclasses import dataclass

LAYOUTS = ("contiguous", "zigzag")


# -- Which rows meet which keys --------------------------------------------------------------

def chunk_ids(rank, world, layout):
    """The chunks of the sequence rank `rank` holds, in order: the sequence is cut into `world`
    chunks (contiguous) or 2 * world (zigzag: chunks rank and 2 * world - 1 - rank)."""
    if layout == "contiguous":
        return (rank,)
    if layout == "zigzag":
        return (rank, 2 * world - 1 - rank)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard(x, rank, world, layout="zigzag", dim=1):
    """This rank's part of a full-sequence array (sequence on axis `dim`), as the ring expects it;
    the length must divide into the layout's chunks. A copy for zigzag (two chunks), a view else."""
    n = x.shape[dim]
    pieces = len(chunk_ids(0, world, layout)) * world
    if n % pieces:
        raise ValueError(f"sequence length {n} does not split into {pieces} equal chunks "
                         f"({layout} layout over {world} ranks)")
    size = n // pieces
    parts = [_take(x, dim, c * size, (c + 1) * size) for c in chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else _concatenate(parts, dim)


def unshard(parts, layout="zigzag", dim=1):
    """The full-sequence array from every rank's part (`parts[r]` from rank r): shard's inverse."""
    world = len(parts)
    per_rank = len(chunk_ids(0, world, layout))
    size = parts[0].shape[dim] // per_rank
    chunks = {}
    for rank, part in enumerate(parts):
        for i, c in enumerate(chunk_ids(rank, world, layout)):
            chunks[c] = _take(part, dim, i * size, (i + 1) * size)
    return _concatenate([chunks[c] for c in sorted(chunks)], dim)


@dataclass(frozen=True)
class Block:
    """The part of one ring step's attention a rank computes: its query rows `rows` against the
    received keys `cols` (slices of the local parts), with the causal diagonal or without."""
    rows: slice
    cols: slice
    causal: bool


ALL = slice(None)


def step_block(rank, src, world, causal, layout, n_local):
    """What rank `rank` computes with the keys of rank `src` (None: nothing; they are all in its
    future). Not causal: everything. Causal, src = rank: the local diagonal (causal within the
    local part, which is right for zigzag too: its first chunk sees none of its second). Causal,
    contiguous: keys from earlier ranks in full, later ranks' not at all. Causal, zigzag: an earlier
    rank's first chunk is before both local chunks and its second after both (all rows x first
    half); a later rank's chunks are both after the first local chunk and before the second
    (second half x all keys): half a block either way."""
    if not causal:
        return Block(ALL, ALL, False)
    if src == rank:
        return Block(ALL, ALL, True)
    if layout == "contiguous":
        return Block(ALL, ALL, False) if src < rank else None
    half = n_local // 2
    if src < rank:
        return Block(ALL, slice(0, half), False)
    return Block(slice(half, n_local), ALL, False)


# -- The few array operations the loops need, for torch tensors or NumPy/CuPy arrays ------------

class _Arrays:
    """Accumulator arithmetic on the local parts: float32 accumulators for 16-bit tensors (the
    inputs' own type when wider), the merge, and slices along the sequence axis."""

    def __init__(self, like):
        self.torch = type(like).__module__.split(".")[0] == "torch"
        if self.torch:
            import torch
            self.xp = torch
            self.acc_dtype = torch.promote_types(like.dtype, torch.float32)
        else:
            import numpy as np
            self.xp = np if isinstance(like, np.ndarray) else __import__(type(like).__module__
                                                                         .split(".")[0])
            self.acc_dtype = np.promote_types(like.dtype, np.float32)

    def acc(self, x):
        return x.to(self.acc_dtype) if self.torch else x.astype(self.acc_dtype)

    def cast(self, x, like):
        return x.to(like.dtype) if self.torch else x.astype(like.dtype)

    def zeros_acc(self, x):
        return self.xp.zeros(x.shape, dtype=self.acc_dtype, **({"device": x.device}
                                                                if self.torch else {}))

    def merge(self, o, lse, o_s, lse_s):
        """Two partial attentions over disjoint keys, as one: O (B, n, H, d) in the accumulator
        type, L (B, H, n) float32; a row no key reached (L = -inf) stays O = 0, L = -inf."""
        xp = self.xp
        new = xp.logaddexp(lse, lse_s)                                        # L
        base = xp.where(xp.isfinite(new), new, xp.zeros_like(new))
        w_old = xp.swapaxes(xp.exp(lse - base), 1, 2)[..., None]              # e^(L_old - L)
        w_s = xp.swapaxes(xp.exp(lse_s - base), 1, 2)[..., None]              # e^(L_s - L)
        return w_old * o + w_s * self.acc(o_s), new


def _take(x, dim, start, stop):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]


def _concatenate(parts, dim):
    mod = type(parts[0]).__module__.split(".")[0]
    if mod == "torch":
        import torch
        return torch.cat(parts, dim=dim)
    return __import__(mod).concatenate(parts, axis=dim)


def _rows(x, rows, axis):
    return x if rows == ALL else _take(x, axis, rows.start, rows.stop)


# -- The ring ----------------------------------------------------------------------------------

class Done:
    """A transfer that is already complete (a ring of one)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


class TorchRing:
    """The ring over a torch.distributed process group (NCCL for CUDA tensors, gloo for CPU ones):
    each exchange is one batch_isend_irecv of every tensor to rank + 1 and from rank - 1, into
    fresh buffers. NCCL runs it on its own stream, after the work already queued on the current
    stream; `wait()` makes the current stream wait for it, so kernels queued in between overlap
    the transfer."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        elif group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not "
                               "initialised (torch.distributed.init_process_group)")
        else:
            self.rank, self.world = 0, 1      # no process group: a ring of one
        if self.world > 1:
            to_global = getattr(dist, "get_global_rank", None)
            self.send_to, self.recv_from = ((self.rank + 1) % self.world,
                                            (self.rank - 1) % self.world)
            if group is not None and to_global is not None:
                self.send_to = to_global(group, self.send_to)
                self.recv_from = to_global(group, self.recv_from)

    def exchange(self, tensors):
        if self.world == 1:
            return Done(tensors)
        import torch
        dist = self.dist
        received = [torch.empty_like(t) for t in tensors]
        ops = ([dist.P2POp(dist.isend, t.contiguous(), self.send_to, self.group) for t in tensors]
               + [dist.P2POp(dist.irecv, r, self.recv_from, self.group) for r in received])
        return _Pending(dist.batch_isend_irecv(ops), received)


class _Pending:
    def __init__(self, requests, received):
        self.requests, self.received = requests, received

    def wait(self):
        for r in self.requests:
            r.wait()
        return self.received


class Timeline:
    """Per-step marks of a ring loop, for the overlap measurement: `mark(name)` records a CUDA
    event on the current stream (torch) or the host clock (else) at each step's start, after its
    kernel was queued ("computed"), and after the current stream waited for the next K/V
    ("received"). With overlap, received - computed is the communication the kernel did not hide."""

    def __init__(self, torch_events=True):
        self.torch_events, self.marks = torch_events, []

    def mark(self, step, name):
        if self.torch_events:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self.marks.append((step, name, event))

    def steps(self):
        """[{mark name: ms since the step's start}] once the work has finished."""
        out = {}
        for step, name, event in self.marks:
            out.setdefault(step, {})[name] = event
        result = []
        for step in sorted(out):
            start = out[step]["start"]
            result.append({name: (start.elapsed_time(ev) if self.torch_events
                                  else 1e3 * (ev - start)) for name, ev in out[step].items()})
        return result


def _mark(timeline, step, name):
    if timeline is not None:
        timeline.mark(step, name)


def ring_forward(q, k, v, ring, local_forward, *, causal, layout="zigzag", overlap=True,
                 timeline=None):
    """Ring attention's forward on this rank's parts: (O in q's type, L float32 (B, H, n_q)).
    local_forward(q, k, v, causal) -> (O, L) is the kernel of one step's block."""
    n = _check_parts(q, k, v, ring.world, causal, layout)
    arrays = _Arrays(q)
    o = lse = None
    kv = (k, v)
    for step in range(ring.world):
        _mark(timeline, step, "start")
        src = (ring.rank - step) % ring.world                  # whose keys this rank holds now
        incoming = _pass_on(ring, kv, step, overlap, timeline)
        block = step_block(ring.rank, src, ring.world, causal, layout, n)
        if block is not None:
            o_s, lse_s = local_forward(_rows(q, block.rows, 1), _rows(kv[0], block.cols, 1),
                                       _rows(kv[1], block.cols, 1), block.causal)
            if o is None:                         # step 0: the local diagonal covers every row
                o, lse = arrays.acc(o_s), lse_s
            else:                                 # (merge)
                o_r, lse_r = arrays.merge(_rows(o, block.rows, 1), _rows(lse, block.rows, 2),
                                          o_s, lse_s)
                o = _assign(o, block.rows, 1, o_r)
                lse = _assign(lse, block.rows, 2, lse_r)
        kv = _received(incoming, kv, step, timeline)
    return arrays.cast(o, q), lse


def ring_backward(do, q, k, v, o, lse, ring, local_backward, *, causal, layout="zigzag",
                  overlap=True, timeline=None):
    """Ring attention's backward on this rank's parts: (dQ, dK, dV) like (q, k, v), from the
    forward's final O and L (this rank's rows). local_backward(do, q, k, v, o, lse, causal) ->
    (dQ, dK, dV) is the variant's backward of one step's block."""
    n = _check_parts(q, k, v, ring.world, causal, layout)
    arrays = _Arrays(q)
    dq = arrays.zeros_acc(q)
    kv, dkv_incoming = (k, v), None
    for step in range(ring.world):
        _mark(timeline, step, "start")
        src = (ring.rank - step) % ring.world
        incoming = _pass_on(ring, kv, step, overlap, timeline)
        block = step_block(ring.rank, src, ring.world, causal, layout, n)
        grads = None
        if block is not None:
            r, c = block.rows, block.cols
            grads = local_backward(_rows(do, r, 1), _rows(q, r, 1), _rows(kv[0], c, 1),
                                   _rows(kv[1], c, 1), _rows(o, r, 1), _rows(lse, r, 2),
                                   block.causal)
        # the running dK, dV of rank src's keys, from the ranks that held them before this one
        if dkv_incoming is None:
            dk, dv = arrays.zeros_acc(k), arrays.zeros_acc(v)
        else:
            dk, dv = dkv_incoming.wait()
        if grads is not None:
            dq_s, dk_s, dv_s = grads
            dq = _add(dq, block.rows, 1, arrays.acc(dq_s))
            dk = _add(dk, block.cols, 1, arrays.acc(dk_s))
            dv = _add(dv, block.cols, 1, arrays.acc(dv_s))
        kv = _received(incoming, kv, step, timeline)
        # on to rank + 1, which holds rank src's keys next; after the last step that is src itself
        dkv_incoming = ring.exchange((dk, dv))
    dk, dv = dkv_incoming.wait()
    return arrays.cast(dq, q), arrays.cast(dk, k), arrays.cast(dv, v)


def _pass_on(ring, kv, step, overlap, timeline):
    """Start sending this step's K/V on (none after the last step); without overlap, wait for the
    transfer before the step's kernel is queued."""
    if step + 1 == ring.world:
        return None
    incoming = ring.exchange(kv)
    if not overlap:
        incoming = Done(incoming.wait())
        _mark(timeline, step, "received")
    return incoming


def _received(incoming, kv, step, timeline):
    """After the step's kernel: the next K/V (waited for here, with overlap), or kv after the last
    step."""
    _mark(timeline, step, "computed")
    if incoming is None:
        return kv
    if isinstance(incoming, Done):      # a ring of one, or overlap=False (received before the kernel)
        return incoming.wait()
    kv = incoming.wait()
    _mark(timeline, step, "received")
    return kv


def _assign(x, rows, axis, value):
    if rows == ALL:
        return value
    index = [slice(None)] * x.ndim
    index[axis] = rows
    x[tuple(index)] = value
    return x


def _add(x, rows, axis, value):
    index = [slice(None)] * x.ndim
    index[axis] = rows
    x[tuple(index)] += value
    return x


def _check_parts(q, k, v, world, causal, layout):
    """This rank's parts must be of equal length (the ring's blocks are all one shape) and, for
    zigzag, of two equal chunks. Returns the local length."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be (batch, seqlen, heads, head_dim) parts of the sequence")
    n = q.shape[1]
    if k.shape[1] != n or v.shape[1] != n:
        raise ValueError(f"context parallelism splits one sequence: q, k and v parts must have the "
                         f"same length, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if layout == "zigzag" and world > 1 and n % 2:
        raise ValueError(f"a zigzag part is two equal chunks: its length {n} must be even")
    return n


# -- The public entry point: torch tensors, torch.distributed, any variant's kernels ---------------

def kernels(variant="fa2", softmax_scale=None, softcap=0.0, forward_options=None,
            backward_options=None):
    """(local_forward, local_backward) of a registered variant, as the ring loops call them."""
    from variants import registry
    fwd_opts, bwd_opts = dict(forward_options or {}), dict(backward_options or {})
    terms = sorted({"alibi_slopes", "sinks", "score_mod", "mask_mod", "block_mask"}
                   & {n for n, x in list(fwd_opts.items()) + list(bwd_opts.items())
                      if x is not None})
    if terms:   # each ring step sees a part of the keys: a sink would join every step's softmax,
        # ALiBi's distances, and the positions a score_mod / mask_mod is passed, would be each
        # part's own (no global offsets yet)
        raise NotImplementedError(f"{', '.join(terms)}: not taken by the context-parallel ring "
                                  "yet (each step would apply it to its own part of the keys)")
    mask = {"softcap": softcap} if softcap else {}

    def local_forward(q, k, v, causal):
        return registry.forward(q, k, v, variant=variant, causal=causal,
                                softmax_scale=softmax_scale, **mask, **fwd_opts)

    def local_backward(do, q, k, v, o, lse, causal):
        return registry.backward(do, q, k, v, o, lse.contiguous(), variant=variant, causal=causal,
                                 softmax_scale=softmax_scale, **mask, **bwd_opts)

    return local_forward, local_backward


def attention(q, k, v, *, group=None, variant="fa2", causal=False, softmax_scale=None,
              softcap=0.0, layout="zigzag", overlap=True, forward_options=None,
              backward_options=None, ring=None, local_kernels=None):
    """O = softmax(softmax_scale Q K^T) V over a sequence split across the ranks of `group`
    (torch.distributed; None: the default group, or a ring of one when none is initialised).
    q, k, v: this rank's parts (B, N / W, H, d) and (B, N / W, H_kv, d) as `shard` cuts them with
    `layout`; returns this rank's part of O, differentiable in q, k, v (torch.autograd).
    softmax_scale defaults to 1 / sqrt(d) of the full problem (the same d). `ring` and
    `local_kernels` replace torch.distributed and the variant's kernels (tests)."""
    if type(q).__module__.split(".")[0] != "torch":
        raise TypeError(f"context_parallel.attention takes torch tensors; q is a "
                        f"{type(q).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ring = ring if ring is not None else TorchRing(group)
    if local_kernels is None:
        local_kernels = kernels(variant, softmax_scale, softcap, forward_options, backward_options)
    settings = dict(causal=causal, layout=layout, overlap=overlap)
    return _function_class().apply(q, k, v, ring, local_kernels, settings)


_FUNCTION = []


def _function_class():
    if _FUNCTION:
        return _FUNCTION[0]
    import torch

    class RingAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, ring, local_kernels, settings):
            o, lse = ring_forward(q, k, v, ring, local_kernels[0], **settings)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.ring, ctx.local_backward, ctx.settings = ring, local_kernels[1], settings
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = ring_backward(do.contiguous(), q, k, v, o, lse, ctx.ring,
                                       ctx.local_backward, **ctx.settings)
            return dq, dk, dv, None, None, None

    _FUNCTION.append(RingAttentionFunction)
    return RingAttentionFunction
