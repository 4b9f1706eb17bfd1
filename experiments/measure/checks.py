"""Is an attention output right? Errors against the float64 reference, with per-dtype tolerances.

With u the unit roundoff of the dtype (2^-8 bf16, 2^-11 fp16): P~ and O are each rounded to the
dtype once, so a correct kernel lands near u/2 in relative L2 error (measured 2e-3 for bf16). The
bounds below leave 2-8x headroom and still catch any wrong row, column or block:
  relative L2 error of O        <= 2 u
  max |O - O_ref|               <= 8 u * max |O_ref|
  max |LSE - LSE_ref|           <= 1e-3            (fp32 statistics of exact products)
and no NaN anywhere (outputs are poisoned with NaN before a test launch).
"""
import numpy as np

from common.hardware.elements import UNIT_ROUNDOFF

LSE_TOL = 1e-3


def compare(o, lse, o_ref, lse_ref, dtype, lse_tol=LSE_TOL):
    """Errors of (o, lse) against the reference and whether they pass; all arrays on the host.
    lse_tol: FP8 inputs move the scores themselves (`fp8_lse_tolerance`)."""
    o = np.asarray(o, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    u = UNIT_ROUNDOFF[dtype]
    finite = bool(np.isfinite(o).all() and not np.isnan(lse).any())
    diff = np.abs(o - o_ref)
    scale = float(np.abs(o_ref).max()) or 1.0
    rel = float(np.linalg.norm(o - o_ref) / (np.linalg.norm(o_ref) or 1.0))
    max_err = float(diff.max()) if diff.size else 0.0
    both_inf = np.isneginf(lse) & np.isneginf(lse_ref)
    with np.errstate(invalid="ignore"):     # -inf - -inf where a row sees no key (both_inf)
        lse_err = float(np.where(both_inf, 0.0, np.abs(lse - lse_ref)).max()) if lse.size else 0.0
    ok = finite and rel <= 2 * u and max_err <= 8 * u * scale and lse_err <= lse_tol
    rmse = float(np.sqrt(np.mean(diff ** 2))) if diff.size else 0.0
    return {"rel_err": rel, "max_err": max_err, "lse_err": lse_err, "rmse": rmse, "ok": bool(ok)}


def fp8_lse_tolerance(q, k, softmax_scale=None):
    """How far L = LSE may move when q and k are rounded to e4m3 (relative error u an element, as
    the quantiser guarantees above the subnormals): |q~.k~ - q.k| <= (2u + u^2) |q| |k|
    (Cauchy-Schwarz), so L moves at most that times the softmax scale, for the largest |q_i|, |k_j|."""
    import math
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    u = UNIT_ROUNDOFF["float8_e4m3fn"]
    bound = (2 * u + u * u) * scale * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
    return float(bound) + LSE_TOL


def compare_gradients(got, ref, dtype):
    """Relative L2 errors of (dq, dk, dv) against float64 gradients and whether they pass:
    <= 2 u each, max error <= 8 u * max |reference|, no NaN (P and dS are rounded to the dtype
    once before their products; a correct kernel measures ~0.6 u)."""
    u = UNIT_ROUNDOFF[dtype]
    out, ok = {}, True
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        x = np.asarray(x, dtype=np.float64)
        rel = float(np.linalg.norm(x - r) / (np.linalg.norm(r) or 1.0))
        max_err = float(np.abs(x - r).max()) if x.size else 0.0
        out[name] = rel
        ok &= bool(np.isfinite(x).all()) and rel <= 2 * u and max_err <= 8 * u * (float(np.abs(r).max()) or 1.0)
    out["ok"] = ok
    return out


def describe_failure(result):
    return (f"rel_err {result['rel_err']:.2e}, max_err {result['max_err']:.2e}, "
            f"lse_err {result['lse_err']:.2e}")


def assert_moved_forward(o, lse, ref, plain, dtype, where, what):
    """Assert that host (o, lse) match the reference `ref` (o, lse) within dtype's bound and do
    not match `plain`, the reference without `what` (a score term, dropout, a mod): a kernel that
    ignored it would fail."""
    got = compare(o, lse, *ref, dtype)
    assert got["ok"], f"forward {where}: " + describe_failure(got)
    assert not compare(o, lse, *plain, dtype)["ok"], \
        f"{where}: {what} did not move the output past the tolerance"
