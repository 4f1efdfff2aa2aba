"""The derived-file cache: entries round-trip, anything unsound is a miss, writes are atomic
(concurrent writers and readers in separate processes never see part of an entry)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os

import pytest

from tokenloom.builtin_plugins.loaders.derived_cache import CACHE_DIR_ENV, FILE_FORMAT, DerivedCache, cache_root

KEY = "0123abcd"


@pytest.fixture
def cache(tmp_path) -> DerivedCache:
    return DerivedCache("things", root=tmp_path)


def test_an_entry_reads_back_its_payload_and_fields(cache):
    assert cache.read(KEY) is None
    path = cache.write(KEY, b"payload \x00\n bytes", {"answer": 42, "text": "two\nlines"})
    assert path == cache.path(KEY) and path.parent.name == "things"
    entry = cache.read(KEY)
    assert entry.payload == b"payload \x00\n bytes"
    assert entry.fields == {"answer": 42, "text": "two\nlines"}
    assert cache.read("another-key") is None


def test_the_root_is_the_cache_dir_env_var_else_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert DerivedCache("kind").directory == tmp_path / "elsewhere" / "kind"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tokenloom"


def test_a_rewrite_replaces_the_entry_and_leaves_no_temporary_file(cache):
    cache.write(KEY, b"first")
    cache.write(KEY, b"second", {"n": 2})
    assert cache.read(KEY).payload == b"second"
    assert sorted(path.name for path in cache.directory.iterdir()) == [f"{KEY}.entry"]


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    header, payload = data.split(b"\n", 1)
    if how == "flipped byte":
        data = header + b"\n" + payload[:3] + bytes([payload[3] ^ 1]) + payload[4:]
    elif how == "truncated":
        data = data[:-2]
    elif how == "padded":
        data = data + b"!"
    elif how == "empty":
        data = b""
    elif how == "garbage header":
        data = b"{not json\n" + payload
    elif how == "other format":
        data = json.dumps({**json.loads(header), "format": "something/0"}).encode() + b"\n" + payload
    elif how == "other key":  # a file renamed (or copied) under the wrong key
        data = json.dumps({**json.loads(header), "key": "feed"}).encode() + b"\n" + payload
    path.write_bytes(data)


@pytest.mark.parametrize(
    "how", ["flipped byte", "truncated", "padded", "empty", "garbage header", "other format", "other key"]
)
def test_an_unsound_entry_is_a_logged_miss_and_a_rewrite_heals_it(cache, caplog, how):
    cache.write(KEY, b"a payload long enough", {"x": 1})
    _damage(cache.path(KEY), how)
    with caplog.at_level(logging.WARNING, logger="tokenloom.builtin_plugins.loaders.derived_cache"):
        assert cache.read(KEY) is None
    assert str(cache.path(KEY)) in caplog.text and "building it again" in caplog.text
    cache.write(KEY, b"a payload long enough", {"x": 1})
    assert cache.read(KEY).fields == {"x": 1}


def test_a_cache_that_cannot_be_written_is_logged_and_skipped(tmp_path, caplog):
    (tmp_path / "blocked").write_text("a file where the cache directory should be")
    cache = DerivedCache("kind", root=tmp_path / "blocked")
    with caplog.at_level(logging.WARNING):
        assert cache.write(KEY, b"data") is None
    assert "cannot write cache entry" in caplog.text
    assert cache.read(KEY) is None


def _write_and_read_many(directory: str, worker: int, rounds: int, queue) -> None:
    cache = DerivedCache("race", root=directory)
    bad_reads = 0
    for round_number in range(rounds):
        # payloads of different lengths: a torn file could not pass for a whole one
        payload = bytes([worker]) * (50_000 + 1000 * worker + round_number)
        cache.write(KEY, payload, {"worker": worker, "round": round_number})
        entry = cache.read(KEY)
        if entry is None or entry.payload != bytes([entry.fields["worker"]]) * len(entry.payload):
            bad_reads += 1
    queue.put(bad_reads)


def test_concurrent_writers_and_readers_only_ever_see_whole_entries(tmp_path):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_write_and_read_many, args=(str(tmp_path), worker, 40, queue)) for worker in range(4)
    ]
    for process in workers:
        process.start()
    results = [queue.get(timeout=120) for _ in workers]
    for process in workers:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results == [0, 0, 0, 0]
    entry = DerivedCache("race", root=tmp_path).read(KEY)
    assert entry is not None and entry.fields["round"] == 39
    assert os.listdir(tmp_path / "race") == [f"{KEY}.entry"]
    assert json.loads((tmp_path / "race" / f"{KEY}.entry").read_bytes().split(b"\n", 1)[0])["format"] == FILE_FORMAT
