"""``rljax.serve.protocol.completion_logprobs`` without a model: a text completion's top log-probs
when two token ids decode to the same text."""

from types import SimpleNamespace

from rljax.serve.protocol import Decoder, completion_logprobs


def test_ids_with_the_same_text_share_one_key_holding_the_likelier_log_prob():
    texts = {1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}  # 2 and 3: byte tokens that each decode to U+FFFD
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "".join(texts[i] for i in ids))
    out = completion_logprobs(Decoder(tokenizer, ()), [1, 4], [-0.5, -1.0],
                              [[(2, -0.2), (3, -0.9)], [(4, -1.0), (1, -2.0)]])
    assert out["tokens"] == ["a", "b"] and out["text_offset"] == [0, 1]
    assert out["top_logprobs"] == [{"\ufffd": -0.2}, {"b": -1.0, "a": -2.0}]
