import pytest

from kvmesh import InvalidRequestError, SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 100}, "logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value)


def test_single_stop_string_is_listified():
    assert SamplingParams(stop="###").stop == ["###"]
