"""fa2's backward switches, each away from its default, against float64 gradients (a file of its
own so that the simulator's suite splits evenly over two workers: tests/conftest.py)."""
import pytest

from tests.conftest import ON_GPU
from tests.test_backward import backward_and_check

pytestmark = pytest.mark.slow

# The backward's switches, each away from its default (dq="atomic", dq_reduce="bulk",
# query_warps=2): each must still give exact gradients.
FA2_BACKWARD_OPTIONS = [dict(dq="separate"), dict(dq_reduce="red"), dict(causal_skip=False),
                        dict(swizzle=False, dq_reduce="red"),   # padded tiles leave no room for
                        # the bulk path's dQ buffer (a clear error)
                        dict(head_dim=128, dq="separate"),
                        # one row of S^T a warp (query_warps=1: P^T, dS^T re-packed in registers)
                        # instead of FA2's 2-D warp tiles, with K_j, V_j held or streamed
                        dict(query_warps=1, kv_in_registers=True),
                        dict(query_warps=1, swizzle=False, dq_reduce="red"),
                        dict(head_dim=128, query_warps=1),
                        dict(head_dim=128, query_warps=1, kv_in_registers=True),
                        # the dQ product's warps away from FA2's split: 2 x 4 at d=64 on a GPU
                        # (16 columns each), 1 x 2 in the simulator's 2-warp tile (32 each)
                        dict(dq_query_warps=2 if ON_GPU else 1),
                        dict(dq_query_warps=2 if ON_GPU else 1, dq_reduce="red")]


@pytest.mark.parametrize("options", FA2_BACKWARD_OPTIONS,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_fa2_backward_options(rng, options):
    options = dict(options)
    head_dim = options.pop("head_dim", 64)
    backward_and_check(rng, "fa2", seqlen=130 if ON_GPU else 40, head_dim=head_dim, causal=True,
                       dtype="float16", **options)
