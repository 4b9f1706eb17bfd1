"""Random attention inputs, and moving arrays between the host and each device array library.

Inputs are drawn on the host (standard normal, like the FlashAttention benchmarks), rounded to the
16-bit dtype there, and copied to the device; the host copies are what the float64 reference sees,
so reference and kernel read exactly the same values. Seeds are fresh unless given, and reported.
"""
import os

import numpy as np

from common.host.arrays import DTYPES, _host_bits, _numba_bits, to_device  # noqa: F401


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")


def alibi_slopes(heads):
    """ALiBi's slopes as its paper sets them, 2^(-8 h / H) for heads h = 1..H, fp32 (H,)."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def random_qkv(rng, batch, seqlen, heads, head_dim, dtype, *, seqlen_k=None, heads_kv=None):
    """Host arrays q (B, N_q, H, d) and k, v (B, N_k, H_kv, d) of `dtype`, entries N(0, 1)."""
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    heads_kv = heads if heads_kv is None else heads_kv
    shapes = [(batch, seqlen, heads, head_dim)] + [(batch, seqlen_k, heads_kv, head_dim)] * 2
    return tuple(rng.standard_normal(s, dtype=np.float32).astype(DTYPES[dtype]) for s in shapes)


def add_outliers(rng, x, fraction, scale=10.0):
    """x plus N(0, scale^2) at a random `fraction` of its entries (FA3 paper, Table 3: 0.1% of
    N(0, 100)), rounded back to x's dtype."""
    extra = scale * rng.standard_normal(x.shape, dtype=np.float32) * (rng.random(x.shape) < fraction)
    return (x.astype(np.float32) + extra).astype(x.dtype)


def default_library():
    """The array library inputs are made with: torch when it sees a GPU (then SDPA peers can run on
    the same tensors), else CuPy, else Numba device arrays (also what the simulator uses)."""
    from common.hardware.target import SIMULATOR
    if SIMULATOR:
        return "numba"
    try:
        import torch
        if torch.cuda.is_available():
            return "torch"
    except ImportError:
        pass
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:
        pass
    return "numba"


def to_host(x):
    """Copy any supported device array back to a NumPy array of its dtype."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if x.dtype == torch.bfloat16:
            return x.detach().view(torch.int16).cpu().numpy().view(DTYPES["bfloat16"])
        return x.detach().cpu().numpy()
    if mod.startswith("cupy"):
        import cupy
        return cupy.asnumpy(x)
    return _numba_bits(x).copy_to_host().view(x.dtype)


def poison(x):
    """Fill a device array with NaN (so an element a kernel fails to write fails the check)."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        x.fill_(float("nan"))
        return x
    if mod.startswith("cupy"):
        x.fill(np.nan)
        return x
    nan = np.full(x.shape, np.nan, dtype=np.float32).astype(x.dtype)
    _numba_bits(x).copy_to_device(_host_bits(nan))
    return x
