"""The zero-copy views kernels see (common/host/arrays.py): shapes, byte strides, aliasing."""
import numpy as np
import pytest

from common.host import arrays
from experiments.measure import inputs


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
    """What `launching.launch` compiles a kernel for: C layout for a C-contiguous view, any layout
    ("A") for a permuted one, the element type of the view (not of the array)."""
    from numba import types
    dev = inputs.to_device(inputs.random_qkv(rng, 2, 5, 3, 64, "bfloat16")[0], inputs.default_library())
    d = arrays.describe(dev)
    assert arrays.bits_view(d, np.uint16).numba_type == types.Array(types.uint16, 4, "C")
    assert arrays.bits_view(d, np.uint16, (0, 2, 1, 3)).numba_type == types.Array(types.uint16, 4, "A")
    assert arrays.bits_view(d, np.uint32, last_dim_divisor=2).numba_type == types.Array(types.uint32, 4, "C")


def test_work_arrays_from_one_allocation_are_aligned_and_apart():
    """arrays.empty_views: each view a multiple of 256 bytes from the allocation's start (itself
    aligned by the device allocator; the simulator's host memory need not be), after the one
    before it, a whole array of its own (writing one leaves the others as they were);
    as_elements re-views one."""
    specs = (((2, 3, 5, 7), np.float32), ((2, 3, 5, 8), np.uint16), ((1,), np.float32))
    views = arrays.empty_views(inputs.default_library(), specs)
    ends = []
    for view, (shape, element) in zip(views, specs):
        assert view.shape == shape and view.dtype == np.dtype(element)
        assert (view.ptr - views[0].ptr) % arrays.SCRATCH_ALIGN == 0
        ends.append((view.ptr, view.ptr + int(np.prod(shape)) * np.dtype(element).itemsize))
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))
    assert ends[-1][1] - ends[0][0] <= arrays.views_bytes(specs)
    for i, view in enumerate(views):
        view.array.copy_to_device(np.full(view.shape, i + 1, view.dtype))
    for i, view in enumerate(views):
        assert (view.array.copy_to_host() == i + 1).all()
    pairs = arrays.as_elements(views[1], np.uint32, 2)
    assert pairs.shape == (2, 3, 5, 4) and pairs.ptr == views[1].ptr
    assert (pairs.array.copy_to_host() == 2 | 2 << 16).all()
