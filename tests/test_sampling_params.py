import pytest

from kvserve import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.greedy
    assert not p.has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
