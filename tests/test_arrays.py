"""The zero-copy views kernels see (common/arrays.py): shapes, byte strides, aliasing."""
import numpy as np
import pytest

from common import arrays, inputs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_paired_permuted_view_aliases_the_array(rng, dtype):
    host = inputs.random_qkv(rng, 2, 5, 3, 64, dtype)[0]          # (B, N, H, d)
    dev = inputs.to_device(host, inputs.default_library())
    d = arrays.describe(dev)
    words = arrays.bits_view(d, np.uint32, (0, 2, 1, 3), last_dim_divisor=2)
    assert words.shape == (2, 3, 5, 32)
    assert words.strides == (5 * 3 * 64 * 2, 64 * 2, 3 * 64 * 2, 4)   # the paired axis: 4-byte steps
    expect = np.ascontiguousarray(host.transpose(0, 2, 1, 3)).view(np.uint32)
    np.testing.assert_array_equal(words.array.copy_to_host(), expect)
    halves = arrays.bits_view(d, np.uint16, (0, 2, 1, 3))
    assert halves.strides == (5 * 3 * 64 * 2, 64 * 2, 3 * 64 * 2, 2)
    np.testing.assert_array_equal(halves.array.copy_to_host(), host.transpose(0, 2, 1, 3).view(np.uint16))


def test_pairing_needs_a_contiguous_even_last_axis(rng):
    dev = inputs.to_device(inputs.random_qkv(rng, 1, 4, 1, 64, "float16")[0], inputs.default_library())
    d = arrays.describe(dev)
    with pytest.raises(ValueError, match="cannot view 2-byte elements 1 at a time"):
        arrays.bits_view(d, np.uint32)


def test_kernel_views_are_typed_like_numba_types_arrays(rng):
    """What `target.launch` compiles a kernel for: C layout for a C-contiguous view, any layout
    ("A") for a permuted one, the element type of the view (not of the array)."""
    from numba import types
    dev = inputs.to_device(inputs.random_qkv(rng, 2, 5, 3, 64, "bfloat16")[0], inputs.default_library())
    d = arrays.describe(dev)
    assert arrays.bits_view(d, np.uint16).numba_type == types.Array(types.uint16, 4, "C")
    assert arrays.bits_view(d, np.uint16, (0, 2, 1, 3)).numba_type == types.Array(types.uint16, 4, "A")
    assert arrays.bits_view(d, np.uint32, last_dim_divisor=2).numba_type == types.Array(types.uint32, 4, "C")
