"""Issue 20 item 3 over HTTP against the real server: a request whose n sequences cannot all
be admitted gets a 4xx and leaves nothing behind. Request ids come from the client
(``request_id``), so a request ``q`` with n=2 (sequences ``cmpl-q#0``, ``cmpl-q#1``) collides
with a live request ``q#1`` on its second sequence; before the fix its first sequence stayed
queued, unreported and unabortable, generating until its max_tokens."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def gauges(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    values = {}
    for name in names:
        found = [
            float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        ]
        assert found, f"{name} not in /metrics"
        values[name] = sum(found)
    return values


def test_a_request_refused_part_way_leaves_nothing_queued(smollm2_server):
    base = smollm2_server.base_url + "/v1/completions"
    long_body = {
        "model": "smollm2",
        "prompt": "Count to a thousand:",
        "max_tokens": 600,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.Client(timeout=120, headers=HEADERS) as client:
        with client.stream("POST", base, json={**long_body, "request_id": "q#1", "stream": True}) as live:
            assert live.status_code == 200
            lines = live.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # q#1 is running
            refused = client.post(base, json={**long_body, "request_id": "q", "n": 2})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert "'cmpl-q#1' is already in use" in error["message"] and error["param"] == "request_id"
        # leaving the stream aborted q#1: with nothing else admitted the engine goes idle at once
        deadline = time.monotonic() + 5.0
        while True:
            values = gauges(smollm2_server)
            if all(value == 0 for value in values.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert values == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0}
        # and the refused id is free: the same request, sent again, is served whole
        served = client.post(base, json={**long_body, "request_id": "q", "n": 2, "max_tokens": 4})
        assert served.status_code == 200, served.text
        assert [choice["finish_reason"] for choice in served.json()["choices"]] == ["length", "length"]
