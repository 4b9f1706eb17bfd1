"""score_mod and mask_mod on a score accumulator: a user's functions, compiled into the kernel.

FlexAttention's interface (and FlashAttention-4's): a variant of the scores is two scalar functions

    score_mod(score, b, h, q_idx, kv_idx, aux) -> score   (score: the scaled QK^T / sqrt(d))
    mask_mod(b, h, q_idx, kv_idx, aux) -> bool            (False: the key is masked, -inf)

and for the backward the derivative of score_mod, as FA4's score_mod_bwd:

    score_mod_grad(grad, score, b, h, q_idx, kv_idx, aux) -> grad * d score_mod / d score

(grad: dLoss / d score_mod(score), score: the unmodified scaled score). b is the batch (a packed
batch's sequence), h the query head, q_idx and kv_idx the positions within the sequence, aux a
tuple of device arrays the call passes. Each is a Numba device function inlined here, so one
kernel is compiled per distinct set of functions (common/host/mods.py makes them and keys them).

The kernels keep raw scores S = Q K^T in their accumulators (softmax_scale enters through the
exponent), so `apply` scales each score for the user's function and unscales its result; the
accumulator's element (m, n, j) of a lane is row row0 + 16 m + lane / 4 + 8 (j / 2), column
col0 + 8 n + 2 (lane % 4) + j % 2 (common/hardware/lanes.py). Transposed accumulators (the
backward's S^T) hold keys in rows and queries in columns. Only elements inside the problem
(q_idx < N_q, kv_idx < N_k) are passed to the functions, so they may index tables of N_q or N_k
entries; the kernels' own masks deal with the rest.
"""
from functools import lru_cache

from numba import cuda, float32, int32

from common.hardware.target import device_function, kernel
from common.tile.tiles import NEG_INF


@device_function
def unmodified(score, b, h, q_idx, kv_idx, aux):
    """The score_mod of a kernel without one (never called: its branch is compiled out)."""
    return score


@device_function
def unmasked(b, h, q_idx, kv_idx, aux):
    """The mask_mod of a kernel without one."""
    return True


@device_function
def unchanged_grad(grad, score, b, h, q_idx, kv_idx, aux):
    """The score_mod_grad of score + bias(b, h, q_idx, kv_idx): the gradient passes unchanged."""
    return grad


@device_function
def element_indices(row0, col0, m, n, j, lane, transposed):
    """(q_idx, kv_idx) of element (m, n, j) of a lane's accumulator whose warp starts at row0,
    col0 (transposed: rows are keys)."""
    r = int32(row0 + m * 16 + (lane >> 2) + 8 * (j >> 1))
    c = int32(col0 + n * 8 + 2 * (lane & 3) + (j & 1))
    if transposed:
        return c, r
    return r, c


@device_function
def tile_inside(s, row0, col0, n_q, n_k, transposed):
    """Whether every element of the warp's accumulator s lies inside the problem (rows from row0,
    columns from col0; transposed: rows are keys)."""
    rows, cols = int32(row0 + 16 * s.shape[0]), int32(col0 + 8 * s.shape[1])
    if transposed:
        return rows <= n_k and cols <= n_q
    return rows <= n_q and cols <= n_k


@lru_cache(maxsize=None)
def applier(score_mod, mask_mod, transposed, keep_scores):
    """apply(s, saved, row0, col0, n_q, n_k, b, h, aux, scale, inv_scale, lane, full): s <- the
    modified scores, in place, for the lane's elements; row0, col0: the warp's first row and the
    tile's first column (transposed: rows are keys); scale, inv_scale: softmax_scale and its
    inverse. keep_scores: each element's scaled score before score_mod is kept in `saved` (same
    shape as s), for score_mod_grad in the backward; full: the block is kept whole (a block
    mask's FULL entry), mask_mod is not evaluated. score_mod or mask_mod None: that step is
    compiled out."""
    SCORE, MASK, KEEP, T = score_mod is not None, mask_mod is not None, keep_scores, transposed
    score_fn = score_mod if SCORE else unmodified
    mask_fn = mask_mod if MASK else unmasked

    @device_function
    def modified(x, saved, m, n, j, q_idx, kv_idx, b, h, aux, scale, inv_scale, full):
        if SCORE:
            score = x * scale
            if KEEP:
                saved[m, n, j] = score
            x = float32(score_fn(score, b, h, q_idx, kv_idx, aux)) * inv_scale
        if MASK and not full:
            if not mask_fn(b, h, q_idx, kv_idx, aux):
                x = NEG_INF
        return x

    @device_function
    def apply(s, saved, row0, col0, n_q, n_k, b, h, aux, scale, inv_scale, lane, full):
        if tile_inside(s, row0, col0, n_q, n_k, T):   # no element test: straight-line code,
            for m in range(s.shape[0]):                # in which loads of aux are shared
                for n in range(s.shape[1]):
                    for j in range(4):
                        q_idx, kv_idx = element_indices(row0, col0, m, n, j, lane, T)
                        s[m, n, j] = modified(s[m, n, j], saved, m, n, j, q_idx, kv_idx, b, h,
                                              aux, scale, inv_scale, full)
        else:
            for m in range(s.shape[0]):
                for n in range(s.shape[1]):
                    for j in range(4):
                        q_idx, kv_idx = element_indices(row0, col0, m, n, j, lane, T)
                        if q_idx < n_q and kv_idx < n_k:
                            s[m, n, j] = modified(s[m, n, j], saved, m, n, j, q_idx, kv_idx, b,
                                                  h, aux, scale, inv_scale, full)

    return apply


@lru_cache(maxsize=None)
def grad_applier(score_mod_grad, transposed):
    """apply_grad(ds, saved, row0, col0, n_q, n_k, b, h, aux, lane): dS <- score_mod_grad(dS,
    score, ...) for the lane's elements inside the problem; `saved` holds the scores
    `applier(..., keep_scores=True)` kept. In a tile that crosses the problem's edge, only the
    elements whose dS is not 0 (score_mod_grad is linear in its first argument: a masked score's
    stays 0, and a function that accumulates into aux does no work for it); inside, every
    element, in straight-line code. score_mod_grad None: compiled out."""
    GRAD, T = score_mod_grad is not None, transposed
    grad_fn = score_mod_grad if GRAD else unchanged_grad

    @device_function
    def apply_grad(ds, saved, row0, col0, n_q, n_k, b, h, aux, lane):
        if GRAD and tile_inside(ds, row0, col0, n_q, n_k, T):   # (a masked score's dS is 0)
            for m in range(ds.shape[0]):
                for n in range(ds.shape[1]):
                    for j in range(4):
                        q_idx, kv_idx = element_indices(row0, col0, m, n, j, lane, T)
                        ds[m, n, j] = float32(grad_fn(ds[m, n, j], saved[m, n, j], b, h, q_idx,
                                                      kv_idx, aux))
        elif GRAD:
            for m in range(ds.shape[0]):
                for n in range(ds.shape[1]):
                    for j in range(4):
                        q_idx, kv_idx = element_indices(row0, col0, m, n, j, lane, T)
                        grad = ds[m, n, j]
                        if q_idx < n_q and kv_idx < n_k and grad != float32(0):
                            ds[m, n, j] = float32(grad_fn(grad, saved[m, n, j], b, h, q_idx,
                                                          kv_idx, aux))

    return apply_grad


def for_kernel(score_mods, transposed, acc_shape):
    """(on, apply, apply_grad, shape of the saved scores) of a kernel built with `score_mods` (a
    configuration's ScoreMods, or None: everything compiled out): applier and grad_applier for
    its accumulator layout, keeping each scaled score (an array of acc_shape) when there is a
    score_mod_grad."""
    if score_mods is None:
        return False, applier(None, None, transposed, False), grad_applier(None, transposed), \
            (1, 1, 1)
    keep = score_mods.score_mod_grad is not None
    return True, applier(score_mods.score_mod, score_mods.mask_mod, transposed, keep), \
        grad_applier(score_mods.score_mod_grad, transposed), acc_shape if keep else (1, 1, 1)


# --------------------------------------------------------------------------- block masks
# A mask_mod's blocks, listed once per geometry (common/host/mods.py BlockMask): for each query
# block i of B_r rows, the key blocks j of B_c keys that hold a kept element, in order, each
# entry j | FULL when every element of the block inside the problem is kept (the kernel then
# evaluates no mask_mod there). A kernel visits the listed blocks only: an empty block costs
# nothing, not even its copy.
FULL = 1 << 30


@device_function
def listed_block(entry):
    """(j, full) of a block list's entry."""
    return int32(entry & (FULL - 1)), entry >= FULL


@device_function
def step_block(blocks, t, listed):
    """(j, full) of a kernel's step t: the t-th entry of its block list (listed; a step past the
    list reads its last entry), or block t itself, not full."""
    if listed:
        return listed_block(blocks[min(t, blocks.shape[0] - 1)])
    return int32(t), False


@device_function
def listed_range(blocks, count, j0, j1):
    """(t0, t1): the entries of a query block's list (`count` of them) whose blocks lie in
    [j0, j1), the band a kernel visits (entries are in increasing j)."""
    t0 = int32(0)
    while t0 < count and int32(blocks[t0] & (FULL - 1)) < j0:
        t0 += 1
    t1 = int32(count)
    while t1 > t0 and int32(blocks[t1 - 1] & (FULL - 1)) >= j1:
        t1 -= 1
    return t0, t1


@lru_cache(maxsize=None)
def block_lister(mask_mod, block_m, block_n, threads, transposed=False):
    """The kernel list_blocks(blocks, counts, n_q, n_k, heads, aux): thread block (i, b * heads +
    h) evaluates mask_mod on every element of query block i against each key block j in turn
    (its threads splitting the B_r x B_c elements) and writes the kept blocks' entries to
    blocks[b, h, i, :] and their number to counts[b, h, i]. transposed: the lists of the key
    blocks (the backward's outer loop), each of the query blocks it meets."""
    BM, BN, THREADS, mask_fn, T = block_m, block_n, threads, mask_mod, transposed

    @kernel
    def list_blocks(blocks, counts, n_q, n_k, heads, aux):
        tid = int32(cuda.threadIdx.x)
        i, bh = int32(cuda.blockIdx.x), int32(cuda.blockIdx.y)
        b, h = int32(bh // heads), int32(bh % heads)
        n = int32(0)
        others = (n_q + BM - 1) // BM if T else (n_k + BN - 1) // BN
        for j in range(others):
            seen, every = int32(0), int32(1)   # (int: the GPU's syncthreads_or/_and take i32)
            for e in range(tid, BM * BN, THREADS):
                q_idx = int32((j if T else i) * BM + e // BN)
                kv_idx = int32((i if T else j) * BN + e % BN)
                if q_idx < n_q and kv_idx < n_k:
                    if mask_fn(b, h, q_idx, kv_idx, aux):
                        seen = int32(1)
                    else:
                        every = int32(0)
            seen_any = cuda.syncthreads_or(seen)
            all_kept = cuda.syncthreads_and(every)
            if seen_any != 0:
                if tid == 0:
                    blocks[b, h, i, n] = int32(j) | (FULL if all_kept != 0 else int32(0))
                n += 1
        if tid == 0:
            counts[b, h, i] = n

    return list_blocks
