"""The step timeout the ``mp`` and ``ray`` executors share: read from
``TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (or vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``),
600 s by default, 0 for none, anything else a start-up error naming the variable."""

from __future__ import annotations

import pytest

from tokenloom.core.executor import (
    DEFAULT_EXECUTE_MODEL_TIMEOUT_SECONDS,
    execute_model_timeout,
)
from tokenloom.errors import ConfigError

OURS, VLLMS = "TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"


@pytest.fixture(autouse=True)
def unset(monkeypatch):
    monkeypatch.delenv(OURS, raising=False)
    monkeypatch.delenv(VLLMS, raising=False)


def test_the_default_is_600_seconds():
    assert execute_model_timeout() == DEFAULT_EXECUTE_MODEL_TIMEOUT_SECONDS == 600.0


def test_vllms_name_works_and_ours_wins(monkeypatch):
    monkeypatch.setenv(VLLMS, "300")
    assert execute_model_timeout() == 300.0
    monkeypatch.setenv(OURS, "2.5")
    assert execute_model_timeout() == 2.5


def test_zero_turns_the_timeout_off(monkeypatch):
    monkeypatch.setenv(OURS, "0")
    assert execute_model_timeout() is None


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_value_is_a_start_up_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(VLLMS, value)
    with pytest.raises(ConfigError, match=rf"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS='{value}' is not a number of seconds"):
        execute_model_timeout()
