"""A pre-imported ``tokenloom serve``: the suite's end-to-end servers forked from one process that
has already imported what every server imports (torch, transformers, fastapi, uvicorn, the
engine and the app), instead of each paying those imports again (about 3 of the 5 CPU seconds
a SmolLM2 server needs to be ready, and most of a scripted model's start).

A forked server then runs ``python -m tokenloom serve ...`` exactly as a cold one does
(``runpy`` over ``tokenloom.__main__`` with the same ``sys.argv``, working directory, output
file and environment), so what the end-to-end tests prove is unchanged; the cold path itself
(the imports, lazy or not, the command line) is proved by tests/e2e/test_startup.py and
tests/api/test_cli.py, which start their own interpreters. A server whose environment differs
from the one the zygote was started with (a test that set a variable some module reads when
imported) starts cold, as does every server when ``TOKENLOOM_TEST_COLD_SERVE=1``.

One zygote per test process, started on its first server. It forks only while its imports left
it one thread: pinned to one core, as each `make test` worker is (tests/conftest.py), torch
starts no OpenMP pool, which a fork would not carry over; elsewhere every server starts cold.
Run as a program, this module is the
zygote: JSON lines on stdin ask for a server (``{"args", "log_path", "cwd", "env"}``), JSON lines on
stdout answer ``{"started": pid}`` and, when a server exits, ``{"exited": pid, "returncode": n}``
(the zygote is the servers' parent, so it reaps them and reports their status)."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping

COLD_ENV = "TOKENLOOM_TEST_COLD_SERVE"
# what every `tokenloom serve` imports, whatever its model and flags (tokenloom/api/server.py)
PRELOADED_MODULES = (
    "torch",
    "transformers",
    "transformers.tokenization_utils_fast",
    # what a server's first AutoConfig / AutoTokenizer call imports (about 730 modules, accelerate
    # and sympy among them: 0.6-2.5 s of a forked server's start), and the suite's usual config
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.configuration_llama",
    "fastapi",
    "uvicorn",
    "tokenloom.api.cli",
    "tokenloom.api.server",
    "tokenloom.core.engine",
    "tokenloom.plugins.manager",
    "tokenloom.api.app",
)


# -- the zygote (this module run as a program) -------------------------------------------------


def _zygote_main() -> None:
    import importlib

    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the zygote's own output goes to its log (stderr)
    # a fork copies only the forking thread: with others running (an OpenMP pool, a monitor),
    # a child could inherit a lock one of them held
    threads = len(os.listdir("/proc/self/task"))
    _reply(replies_fd, {"ready": threads == 1, "threads": threads})
    buffered = b""
    while True:
        _reap(replies_fd)
        readable, _, _ = select.select([requests_fd], [], [], 0.05)
        if not readable:
            continue
        chunk = os.read(requests_fd, 65536)
        if not chunk:
            return  # the test process is gone; its servers are stopped by their fixtures
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become_server(request, (requests_fd, replies_fd, devnull))  # never returns
            _reply(replies_fd, {"started": pid})


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _reap(replies_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(replies_fd, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become_server(request: dict, inherited_fds: tuple[int, ...]) -> None:
    """In the forked child: ``python -m tokenloom <args>`` with the request's output file and
    working directory; exits with the command's status (atexit handlers run, as in a cold one)."""
    try:
        log = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (log, *inherited_fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # a fresh process's state where a fork would copy the zygote's
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import runpy

        sys.argv = ["tokenloom", *request["args"]]
    except BaseException:  # noqa: BLE001 -- the child must never return into the zygote's loop
        os._exit(127)
    code = 0
    try:
        runpy.run_module("tokenloom", run_name="__main__", alter_sys=True)
    except SystemExit as exit_request:
        if exit_request.code is None or isinstance(exit_request.code, int):
            code = exit_request.code or 0
        else:
            print(exit_request.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    # what the interpreter's exit does that the command can see (atexit handlers, flushed
    # output), then an immediate exit: a forked interpreter's own finalization can spin on
    # state its parent's imports left (torch's), where a cold process has exited long since
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- the test process's side -------------------------------------------------------------------


class ForkedServer:
    """What the tests use of a ``subprocess.Popen``, for a server the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote = zygote
        self.pid = pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self.zygote.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.returncode) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # exited since: the zygote reports it next

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's handle on its zygote."""

    def __init__(self, env: dict[str, str], cwd: str, log_path: str):
        self.env = env
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.serve_zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=cwd,
                env=env,
            )
        self.lock = threading.Lock()
        self.buffered = b""
        self.exited: dict[int, int] = {}
        self.started: list[int] = []
        ready = self._next_message(timeout=240)
        self.usable = bool(ready and ready.get("ready"))

    def _next_message(self, timeout: float) -> dict | None:
        """The zygote's next reply (exit reports are recorded, not returned), None on time-out."""
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while True:
            while b"\n" in self.buffered:
                line, self.buffered = self.buffered.split(b"\n", 1)
                message = json.loads(line)
                if "exited" in message:
                    self.exited[message["exited"]] = message["returncode"]
                else:
                    return message
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the zygote died
            self.buffered += chunk

    def fork(self, args: list[str], log_path: str, cwd: str, env: dict[str, str]) -> ForkedServer | None:
        with self.lock:
            if not self.usable or self.process.poll() is not None:
                return None
            assert self.process.stdin is not None
            request = {"args": args, "log_path": log_path, "cwd": cwd, "env": env}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            reply = self._next_message(timeout=60)
            if reply is None:
                self.usable = False
                return None
            return ForkedServer(self, reply["started"], args)

    def returncode(self, pid: int) -> int | None:
        with self.lock:
            if pid not in self.exited:
                self._next_message(timeout=0)
            if pid not in self.exited and self.process.poll() is not None:
                # the zygote is gone: the server is an orphan, reaped by init; ask the kernel
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    self.exited[pid] = -signal.SIGKILL
            return self.exited.get(pid)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


_zygote: Zygote | None = None
# variables no preloaded module reads when imported, so a forked server, which gets the value of
# the environment it was asked for, is the server a cold start would give: pytest's per-test
# variable, and what a test's `ray.init` leaves in the test process (its client mode and
# breakpoint hook; Ray is not preloaded), which had made every later server of that test process
# start cold
IGNORED_VARIABLES = ("PYTEST_CURRENT_TEST", "PYTHONBREAKPOINT")
IGNORED_PREFIXES = ("RAY_",)


def _lasting(env: Mapping[str, str]) -> dict[str, str]:
    return {
        name: value
        for name, value in env.items()
        if name not in IGNORED_VARIABLES and not name.startswith(IGNORED_PREFIXES)
    }


# the test process's environment before any test changed it: the zygote starts only from a
# server asked for in it, so that a test that sets a variable for its own servers leaves the
# zygote's environment the one every other server is started with
_environ_before_tests = _lasting(os.environ)


def record_environment_before_tests() -> None:
    """Take the environment as collection left it (tests/conftest.py calls this once the session
    has collected): the test modules' imports set variables of their own (torch's inductor its
    cache directory, Ray its client mode), and against the environment this module was imported
    in, no server of the whole suite would find it unchanged and none would fork."""
    global _environ_before_tests
    _environ_before_tests = _lasting(os.environ)


def start_serve(args: list[str], log_path: str, cwd: str, env: dict[str, str]) -> ForkedServer | subprocess.Popen:
    """``python -m tokenloom <args>`` writing to ``log_path``: forked from this process's
    zygote when ``env`` is the environment the zygote started with, else a cold process."""
    global _zygote
    if os.environ.get(COLD_ENV) != "1":
        if _zygote is None and _lasting(os.environ) == _environ_before_tests:
            _zygote = Zygote(env, cwd, log_path + ".zygote")
            atexit.register(_zygote.close)
        if _zygote is not None and _lasting(_zygote.env) == _lasting(env):
            forked = _zygote.fork(args, log_path, cwd, env)
            if forked is not None:
                return forked
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenloom", *args], stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )


if __name__ == "__main__":
    _zygote_main()
