"""SamplingParams' checks on construction that the HTTP layer does not make for offline callers."""

from __future__ import annotations

import math

import pytest

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import InvalidRequestError


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"logit_bias": {42: math.inf}}, "logit_bias"),
        ({"logit_bias": {"42": -math.inf}}, "logit_bias"),
        ({"logit_bias": {42: math.nan}}, "logit_bias"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ],
)
def test_non_finite_sampling_values_are_refused_naming_the_field(fields, param):
    # issue 37: a NaN temperature or an infinite logit_bias passed and only emptied the output
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**fields)
    assert error.value.param == param


def test_finite_extremes_are_kept():
    params = SamplingParams(temperature=0.0, logit_bias={"7": -100.0, 8: 100})
    assert params.logit_bias == {7: -100.0, 8: 100.0} and params.greedy
