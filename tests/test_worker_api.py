"""tokenloom.worker_api, the public surface of executor and proposer plugins: every name it
lists resolves, lazily (importing it imports no torch), to the core's own object."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenloom import worker_api


def test_every_listed_name_resolves_to_the_object_it_stands_for():
    from tokenloom.core.executor import Executor
    from tokenloom.core.worker import Worker
    from tokenloom.plugins.registry import resolve_target

    assert set(worker_api.__all__) == set(worker_api._LAZY)
    for name in worker_api.__all__:
        assert getattr(worker_api, name) is not None, name
    assert worker_api.Executor is Executor and worker_api.Worker is Worker
    assert worker_api.resolve_target is resolve_target


def test_importing_it_imports_no_torch():
    code = (
        "import sys, tokenloom.worker_api, tokenloom.builtin_plugins.executors.uniproc; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        worker_api.NoSuchName  # noqa: B018
