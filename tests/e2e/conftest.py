"""The real `tokenloom serve` process on a free loopback port: started once per test module, or
once per session for the plain `smollm2_server` several modules share; forked from the test
process's pre-imported zygote (tests/e2e/serve_zygote.py), so no server pays the imports again."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import time

import httpx
import pytest

from tests.e2e.serve_zygote import ForkedServer, start_serve

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "e2e-secret"


# its own generator: a test that seeds `random` must not make two workers pick the same ports
_PORTS = random.SystemRandom()


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for port 0 and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low, high = (int(part) for part in ports.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports, below the ephemeral range: a server binds its
    port seconds after the test picked it, and a port the kernel may hand out meanwhile (a port-0
    bind, any outgoing connection) was taken in between once (`Address already in use` for a
    node's control port in a clean-clone run); below the range only other explicit picks land."""
    low, _ = ephemeral_ports()
    while True:
        port = _PORTS.randrange(10000, max(10000 + count, low - count))
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return port


def free_port() -> int:
    return free_ports(1)


def free_port_pair() -> int:
    """A port that is free together with the one after it (``--master-port`` and the nodes'
    control port, ``--master-port + 1``)."""
    return free_ports(2)


class RunningServer:
    def __init__(self, process: ForkedServer | subprocess.Popen, base_url: str, log_path: str):
        self.process = process
        self.base_url = base_url
        self.log_path = log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as handle:
            return handle.read()


def start_server(args: list[str], log_path: str, timeout: float = 240.0) -> RunningServer:
    port = free_port()
    process = launch_serve([*args, "--host", "127.0.0.1", "--port", str(port)], log_path)
    return wait_ready(RunningServer(process, f"http://127.0.0.1:{port}", log_path), timeout)


def serve_environment(**extra: str) -> dict[str, str]:
    """The environment the suite's servers run in: this process's, with the repository on the
    path, and ``extra``."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # OpenMP threads that sleep while they wait: the suite runs servers beside each other and
    # beside pytest workers on few cores, and spinning waiters then steal the time slices of the
    # threads they wait for (a SmolLM2 decode fell to 0.2 tokens/s under such load; passive,
    # the draft-model proofs took 3 minutes where one thread per server took 10). Speed only:
    # the arithmetic is the same
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return {**env, **extra}


def launch_serve(args: list[str], log_path: str) -> ForkedServer | subprocess.Popen:
    """``tokenloom serve <args>`` started (not waited for) with its output in ``log_path``:
    forked from the test process's pre-imported zygote (tests/e2e/serve_zygote.py), which
    saves each server the imports every server makes."""
    return start_serve(["serve", *args], log_path, REPO_ROOT, serve_environment())


def wait_ready(server: RunningServer, timeout: float = 240.0) -> RunningServer:
    """``server`` once its /health answers (polled often: the suite starts dozens of servers and
    each would otherwise wait for the next poll); killed and an error with its log's tail when
    it exits or is not ready within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"tokenloom serve exited with {server.process.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.process.kill()
    raise RuntimeError(f"tokenloom serve was not ready after {timeout}s:\n{server.log()[-4000:]}")


def stop_server(server: RunningServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


# the speculative-decoding proofs' rewrite prompt: the answer repeats most of the prompt, so prompt
# lookup has drafts to verify
CODE = """def total_price(items):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total
"""
REWRITE = f"Rewrite this Python function, renaming `total` to `result` and changing nothing else:\n\n{CODE}"


def spec_decode_counter(server: RunningServer, model_name: str, name: str) -> float:
    """The server's ``vllm:spec_decode_<name>_total`` counter (``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens``) for ``model_name``, read from /metrics."""
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    match = re.search(rf'^vllm:spec_decode_{name}_total\{{model_name="{re.escape(model_name)}"\}} (\S+)$', text, re.M)
    assert match, f"the spec-decode metric {name} is missing"
    return float(match.group(1))


def spec_decode_accepted_per_position(server: RunningServer, model_name: str) -> list[float]:
    """The server's ``vllm:spec_decode_num_accepted_tokens_per_pos_total`` counters for
    ``model_name``, position 0 first (one per draft position the server can propose)."""
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    pattern = (
        rf"^vllm:spec_decode_num_accepted_tokens_per_pos_total"
        rf'\{{model_name="{re.escape(model_name)}",position="(\d+)"\}} (\S+)$'
    )
    by_position = {int(position): float(value) for position, value in re.findall(pattern, text, re.M)}
    assert by_position, "the spec-decode metric num_accepted_tokens_per_pos is missing"
    assert sorted(by_position) == list(range(len(by_position))), f"positions missing: {sorted(by_position)}"
    return [by_position[position] for position in range(len(by_position))]


def serve_smollm2(tmp_path_factory, extra_args: list[str] = ()):
    """The shared SmolLM2 server (with ``extra_args`` added), stopped when the generator ends."""
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    server = start_server(
        [
            "smollm2",
            "--max-model-len",
            "1024",
            "--api-key",
            API_KEY,
            "--middleware",
            "tests.e2e.header_middleware.add_served_by_header",
            *extra_args,
        ],
        log_path,
    )
    yield server
    stop_server(server)


# one server for the whole session: every module that uses it (admission, agent APIs, the
# server's own tests) wants the same flags and leaves it idle, and a start costs seconds
@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    yield from serve_smollm2(tmp_path_factory)


@pytest.fixture(scope="session")
def scripted_tokenizer(smollm2_gguf):
    """SmolLM2's tokenizer, for the scripted model's directories (tests/e2e/scripted.py)."""
    from tests.plugins.scripted_model.model_dir import load_tokenizer

    return load_tokenizer(smollm2_gguf)
