"""The test oracle's own pieces against the op: the numpy projection of proj_bits
(attention_reference.projection_matrix) is the C++ one (popcount_attention.cc), bit for bit."""
import numpy as np
import pytest

from ortsparse import _kernels
from ortsparse.proc_sparse import splitmix64

from . import attention_reference as ref


@pytest.mark.parametrize("d, bits", [(1, 1), (3, 5), (7, 3), (48, 64), (64, 128), (64, 256), (129, 255)])
def test_projection_matrix_equals_the_ops_bit_for_bit(d, bits):
    ours = ref.projection_matrix(d, bits)
    op = _kernels.projection_matrix(d, bits)
    assert ours.dtype == op.dtype == np.float32 and ours.shape == op.shape == (d, bits)
    np.testing.assert_array_equal(ours.view(np.uint32), op.view(np.uint32))


def test_projection_matrix_is_a_prefix_of_one_stream():
    """Row-major over one stream: a matrix with more columns starts with the same values."""
    small, large = ref.projection_matrix(2, 8).ravel(), ref.projection_matrix(4, 8).ravel()
    np.testing.assert_array_equal(small, large[:16])
    assert abs(large.mean()) < 1.0 and 0.3 < large.std() < 3.0


def test_splitmix64_stream_matches_the_pure_python_hash():
    """A second, scalar implementation (proc_sparse.splitmix64: output number i of the stream)."""
    seed = 0x243F6A8885A308D3
    stream = ref.splitmix64_stream(seed, 40)
    assert [int(v) for v in stream] == [splitmix64(seed, 0, i) for i in range(40)]
