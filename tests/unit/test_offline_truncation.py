"""Offline rows cut to max_completion_length: a pair or ranked list whose responses differ only past
the cut would train on identical completions (zero gradient, no signal), so it is dropped and counted."""

import logging

import pytest

from rljax.data.encoded import encode_rows
from rljax.models.tiny import byte_tokenizer

TOKENIZER = byte_tokenizer()  # one token per byte


def _encode(rows, *, too_long="truncate", length=6, append_eos=False):
    return encode_rows(rows, TOKENIZER, render=lambda p: p, assistant_prefix="", max_prompt_length=64,
                       prompt_too_long="error", max_completion_length=length, completion_too_long=too_long,
                       append_eos=append_eos, split="train")


ROWS = [
    {"prompt": "p0", "chosen": "abcdefXX", "rejected": "abcdefYY", "key": "0"},  # differ past 6 tokens
    {"prompt": "p1", "chosen": "abcXXXXX", "rejected": "abcYYYYY", "key": "1"},  # differ within
    {"prompt": "p2", "chosen": "abcdef", "rejected": "abcdefZZ", "key": "2"},  # equal once cut
    {"prompt": "p3", "chosen": "abc", "rejected": "abcd", "key": "3"},  # short, different
]
RANKED = [
    {"prompt": "q0", "responses": ["xyzuvwA", "xyzuvwB", "other"], "key": "0"},  # first two equal once cut
    {"prompt": "q1", "responses": ["xyzuvw", "xyzuv", "other"], "key": "1"},
]


def test_pairs_identical_after_truncation_are_dropped_and_counted(caplog):
    with caplog.at_level(logging.WARNING, logger="rljax.data.encoded"):
        data, dropped = _encode(ROWS)
    assert [r["key"] for r in data.rows] == ["1", "3"]
    assert dropped == {"identical_after_truncation": 2}
    assert all(len({tuple(c) for c in cs}) == 2 for cs in data.completions)
    assert data.completions[0] == [TOKENIZER("abcXXX")["input_ids"], TOKENIZER("abcYYY")["input_ids"]]
    assert "train: 2 of 4 rows dropped" in caplog.text and "max_completion_length=6" in caplog.text
    # tokens are compared, EOS included: cut to 7, "abcdef" + EOS and "abcdefZ" differ
    data, dropped = _encode(ROWS, length=7, append_eos=True)
    assert len(data) == 4 and dropped == {}


def test_ranked_lists_with_two_responses_identical_after_truncation_are_dropped():
    data, dropped = _encode(RANKED)
    assert [r["key"] for r in data.rows] == ["1"] and dropped == {"identical_after_truncation": 1}


def test_long_enough_completions_keep_every_row_and_filter_and_error_are_unchanged():
    data, dropped = _encode(ROWS, length=16)
    assert len(data) == 4 and dropped == {}
    data, dropped = _encode(ROWS, too_long="filter")
    assert [r["key"] for r in data.rows] == ["3"] and dropped == {"response_too_long": 3}
    with pytest.raises(ValueError, match="over algorithm.max_completion_length=6"):
        _encode(ROWS, too_long="error")
