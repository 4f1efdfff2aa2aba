"""The end-to-end tests' pre-imported zygote (tests/e2e/serve_zygote.py): a command it forks runs
as ``python -m tokenloom`` does (output, exit status, signals), and one whose environment
differs from the zygote's starts cold. Forks happen where the zygote is usable (its imports
left it single-threaded: a test process pinned to one core, as each `make test` worker is)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.e2e import serve_zygote
from tests.e2e.conftest import REPO_ROOT, serve_environment
from tests.e2e.serve_zygote import ForkedServer, start_serve
from tokenloom import __version__


def expected_kind():
    if os.environ.get(serve_zygote.COLD_ENV) == "1":
        return subprocess.Popen
    start_serve(["--version"], os.devnull, REPO_ROOT, serve_environment()).wait(timeout=60)  # the zygote is up
    zygote = serve_zygote._zygote
    lasting = serve_zygote._lasting
    forks = zygote is not None and zygote.usable and lasting(zygote.env) == lasting(serve_environment())
    return ForkedServer if forks else subprocess.Popen


def test_a_forked_command_writes_its_output_and_exit_status(tmp_path):
    kind = expected_kind()
    log = tmp_path / "version.log"
    process = start_serve(["version"], str(log), REPO_ROOT, serve_environment())
    assert isinstance(process, kind)
    assert process.wait(timeout=60) == 0 and process.returncode == 0 and process.poll() == 0
    assert __version__ in log.read_text()
    refused = start_serve(
        ["serve", "smollm2", "--no-such-flag"], str(tmp_path / "refused.log"), REPO_ROOT, serve_environment()
    )
    assert isinstance(refused, kind)
    assert refused.wait(timeout=60) == 2
    assert "--no-such-flag" in (tmp_path / "refused.log").read_text()


def test_a_forked_command_takes_signals_and_a_wait_times_out(tmp_path):
    kind = expected_kind()
    # a server still loading its model (a second at least): killed long before it could listen
    loading = start_serve(
        ["serve", "smollm2", "--port", "1"], str(tmp_path / "loading.log"), REPO_ROOT, serve_environment()
    )
    assert isinstance(loading, kind)
    with pytest.raises(subprocess.TimeoutExpired):
        loading.wait(timeout=0.05)
    loading.send_signal(signal.SIGKILL)
    assert loading.wait(timeout=60) == -signal.SIGKILL and loading.poll() == -signal.SIGKILL
    loading.kill()  # a signal to a process that has exited is ignored, as Popen ignores it


def test_a_command_whose_environment_differs_from_the_zygotes_starts_cold(tmp_path):
    expected_kind()
    process = start_serve(
        ["version"], str(tmp_path / "cold.log"), REPO_ROOT, serve_environment(TOKENLOOM_ZYGOTE_PROBE="1")
    )
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=60) == 0
