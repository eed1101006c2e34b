"""The one padding helper: hand-written expected arrays."""

import numpy as np
import pytest

from rljax.batches import pad_sequences


def test_left_and_right_padding():
    ids, mask = pad_sequences([[5, 6, 7], [8]], side="left", pad_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
    ids, mask = pad_sequences([[5, 6, 7], [8]], side="right", pad_id=9)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 9, 9]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 0, 0]])
    assert ids.dtype == mask.dtype == np.int32


def test_buckets_width_and_extra_rows():
    ids, mask = pad_sequences([[1, 2, 3]], side="left", pad_id=0, buckets=(2, 4, 8), num_rows=2)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 0]])
    ids, _ = pad_sequences([[1], []], side="right", pad_id=7, width=3)
    np.testing.assert_array_equal(ids, [[1, 7, 7], [7, 7, 7]])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="row 0 has 3 tokens, over the width 2"):
        pad_sequences([[1, 2, 3]], side="left", pad_id=0, width=2)
    with pytest.raises(ValueError, match="largest bucket 2"):
        pad_sequences([[1, 2, 3]], side="left", pad_id=0, buckets=(1, 2))
    with pytest.raises(ValueError, match="side must be"):
        pad_sequences([[1]], side="middle", pad_id=0)
    with pytest.raises(ValueError, match="do not fit num_rows=1"):
        pad_sequences([[1], [2]], side="left", pad_id=0, num_rows=1)
