"""The shape-bucket rule shared by the sampler and the prompt batcher."""

import pytest

from rljax.buckets import bucket_length, bucket_sizes


def test_bucket_length_powers_of_two_and_midpoints():
    assert [bucket_length(n, per_octave=2) for n in (1, 16, 17, 24, 25, 33, 45, 49, 64, 65, 97, 129)] == [
        16, 16, 24, 24, 32, 48, 48, 64, 64, 96, 128, 192]
    assert [bucket_length(n, 8, 2) for n in (1, 8, 9, 13, 16, 17)] == [8, 8, 12, 16, 16, 24]
    assert [bucket_length(n, 1, 2) for n in range(1, 10)] == [1, 2, 3, 4, 6, 6, 8, 8, 12]


def test_default_is_four_buckets_per_octave():
    # the grpo_step benchmark's 39-token prompts: 40, not 48
    assert [bucket_length(n) for n in (1, 16, 17, 39, 41, 45, 49, 57, 65)] == [16, 16, 20, 40, 48, 48, 56, 64, 80]
    assert [bucket_length(n, 8) for n in (1, 8, 9, 11, 13, 16, 17)] == [8, 8, 10, 12, 14, 16, 20]


def test_four_buckets_per_octave():
    assert bucket_sizes(128, 16, per_octave=4) == (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
    assert [bucket_length(n, 16, 4) for n in (13, 17, 34, 57, 129)] == [16, 20, 40, 64, 160]
    for n in range(17, 5000):
        size = bucket_length(n, 16, 4)
        assert size >= n and (size - n) / size < 1 / 5 + 1e-9
    with pytest.raises(ValueError, match="per_octave"):
        bucket_length(5, 16, 0)


def test_padding_is_at_most_a_third_of_a_bucket():
    for n in range(17, 5000):
        size = bucket_length(n, 16, 2)
        assert size >= n and (size - n) / size < 1 / 3 + 1e-9


def test_bucket_sizes_end_at_the_maximum():
    assert bucket_sizes(256, per_octave=2) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert bucket_sizes(100) == (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 100)
    assert bucket_sizes(16) == (16,) and bucket_sizes(8) == (8,)
    with pytest.raises(ValueError, match="maximum"):
        bucket_sizes(0)
