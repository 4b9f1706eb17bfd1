"""Which keys a query sees: causal and sliding-window masks as one band, and logit soft-capping.

flash_attn's conventions (flash_attn_func's `causal`, `window_size=(left, right)`, `softcap`):
- query row r (0 <= r < N_q) sees key c (0 <= c < N_k) when
      r + shift - left <= c <= r + shift + right,
  with shift = N_k - N_q ("bottom_right", flash_attn >= 2.1: the last query row sees the last key,
  as when the queries are the newest tokens of a longer sequence) or 0 ("top_left", torch's
  `is_causal`); left or right = -1 is unbounded, and causal is right = 0.
- So every mask here is a band of diagonals, lo <= c - r <= hi (`Band`): causal is
  (-inf, shift], a sliding window [shift - left, shift + right]. A kernel takes lo and hi as two
  int32 arguments; which K/V blocks a query block meets (`key_blocks`, `query_blocks`) and
  whether a block crosses the band's edge (`block_is_partial`) follow from them, so blocks
  outside the band are skipped (cost grows as N * window, not N^2) and only the blocks on its
  edges are masked.
- A query row that sees no key (bottom-right causal with N_q > N_k: the first N_q - N_k rows)
  gets O = 0 and LSE = -inf, as in flash_attn.
- softcap > 0 (Gemma 2): scores s = softmax_scale * q.k become softcap * tanh(s / softcap) before
  the softmax. The kernels keep raw scores q.k and apply softmax_scale in the exponent, so they cap
  raw scores at softcap / softmax_scale (`Band.softcap_raw`); the backward multiplies dS by the
  derivative, 1 - tanh^2.
"""
from dataclasses import dataclass

from numba import cuda, int32

from common.hardware.target import device_function

BOTTOM_RIGHT, TOP_LEFT = "bottom_right", "top_left"
ALIGNS = (BOTTOM_RIGHT, TOP_LEFT)
UNBOUNDED = 1 << 30     # |c - r| never reaches this: a side of the band that is not there


@dataclass(frozen=True)
class Band:
    """The keys each query sees: lo <= key - query <= hi. banded: some key is masked by the band
    (causal or a window), so the kernels compile their block range and edge masking in; windowed:
    the band has a left edge (a sliding window), so they compile its test in too (causal alone
    keeps the instructions and registers of a plain causal kernel)."""
    lo: int = -UNBOUNDED
    hi: int = UNBOUNDED
    softcap: float = 0.0        # as the caller gave it (0: none)
    softcap_raw: float = 0.0    # softcap / softmax_scale: the cap on raw scores q.k

    @property
    def banded(self):
        return self.lo > -UNBOUNDED or self.hi < UNBOUNDED

    @property
    def windowed(self):
        return self.lo > -UNBOUNDED


def window_of(window_size):
    """window_size as a checked (left, right) pair of ints, -1 = unbounded."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, -1 meaning "
                         f"unbounded, got {window_size!r}") from None
    if (left, right) != tuple(window_size) or min(left, right) < -1:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1: "
                         f"unbounded), got {window_size!r}")
    return left, right


def band(causal, window_size, align, n_q, n_k, softcap, softmax_scale):
    """The Band of a call (flash_attn's conventions, above), or a ValueError naming the problem."""
    left, right = window_of(window_size)
    if align not in ALIGNS:
        raise ValueError(f"align must be {' or '.join(map(repr, ALIGNS))}, got {align!r}")
    try:
        softcap = float(softcap)
    except (TypeError, ValueError):
        raise ValueError(f"softcap must be a number >= 0 (0: none), got {softcap!r}") from None
    if not softcap >= 0 or softcap == float("inf"):
        raise ValueError(f"softcap must be a finite number >= 0 (0: none), got {softcap}")
    if max(n_q, n_k) >= UNBOUNDED // 2:
        raise ValueError(f"sequence lengths must be below {UNBOUNDED // 2}, got {n_q} and {n_k}")
    shift = n_k - n_q if align == BOTTOM_RIGHT else 0
    if causal:
        right = 0 if right < 0 else min(right, 0)
    lo = shift - left if left >= 0 else -UNBOUNDED
    hi = shift + right if right >= 0 else UNBOUNDED
    if softcap and softmax_scale == 0:   # every score is 0, capped or not
        softcap = 0.0
    return Band(lo, hi, softcap, softcap / softmax_scale if softcap else 0.0)


# --------------------------------------------------------------------------- device side
# Block ranges in 32-bit integers (the band's UNBOUNDED sides keep every sum inside int32).

@device_function
def query_block(longest_first):
    """The query block this thread block owns when the grid's x runs over query blocks: blockIdx.x,
    or counted from the end when longest_first (under a causal band the last query blocks meet the
    most key blocks: launched first, they do not start in the grid's last wave)."""
    return cuda.gridDim.x - 1 - cuda.blockIdx.x if longest_first else cuda.blockIdx.x


@device_function
def key_blocks(row0, rows, n_q, n_k, block, lo, hi):
    """(j0, j1): key blocks j0 <= j < j1 of `block` keys hold every key that the query rows
    row0 .. row0 + rows - 1 (those below n_q) see (j1 <= j0: none)."""
    first = max(int32(row0 + lo), int32(0))
    last = min(int32(min(int32(row0 + rows), n_q) - 1 + hi), int32(n_k - 1))
    j0 = int32(first // block)
    j1 = int32(last // block + 1) if last >= first else j0
    return j0, j1


@device_function
def query_blocks(key0, keys, n_q, n_k, block, lo, hi):
    """(i0, i1): query blocks i0 <= i < i1 of `block` rows hold every query that sees one of the
    keys key0 .. key0 + keys - 1 (those below n_k); i1 <= i0: none. Query r sees key c when
    c - hi <= r <= c - lo. (The two ranges agree: block i lies in query_blocks(j) exactly when
    block j lies in key_blocks(i).)"""
    first = max(int32(key0 - hi), int32(0))
    last = min(int32(min(int32(key0 + keys), n_k) - 1 - lo), int32(n_q - 1))
    i0 = int32(first // block)
    i1 = int32(last // block + 1) if last >= first else i0
    return i0, i1


@device_function
def block_is_partial(row0, rows, col0, cols, n_k, banded, lo, hi, windowed=True):
    """True if the block of queries row0.. (rows) and keys col0.. (cols) has a score to mask: a key
    past n_k or (banded) a pair outside lo <= c - r <= hi (windowed=False: no left edge, lo is not
    read). (Queries past N_q are the caller's.)"""
    if int32(col0 + cols) > n_k:
        return True
    if banded:
        if int32(col0 + cols - 1 - row0) > hi:
            return True
        return windowed and int32(col0 - (row0 + rows - 1)) < lo
    return False
