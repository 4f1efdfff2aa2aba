"""The suite's xdist scheduler (tests/helpers/xdist_scheduling.py), driven as xdist's controller
drives it, with two fake workers: units go out longest first, groups split a module."""

from __future__ import annotations

import json
import os

from helpers.xdist_scheduling import (
    LongestFirstScopeScheduling,
    SecondsRecorder,
    estimated_seconds,
    read_slow_units,
    remove_slow_units_dir,
    scope_of,
    slow_units_dir,
    write_slow_units,
)


class FakeConfig:
    option = type("Option", (), {"loadscopereorder": True})()  # xdist's default

    def __init__(self):
        self.stash = {}

    def getvalue(self, name):
        return {"tx": ["2*popen"], "loadscopereorder": True}[name]


class FakeWorker:
    def __init__(self, name: str):
        self.name, self.shutting_down, self.sent = name, False, []
        self.gateway = type("Gateway", (), {"id": name})()

    def send_runtest_some(self, indexes):
        self.sent.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


COLLECTION = [
    # many quick tests: first under plain loadscope
    *[f"tests/core/test_many.py::test_{i}" for i in range(6)],
    "tests/e2e/test_server.py::test_one",
    "tests/e2e/test_server.py::test_two",
    "tests/e2e/test_split.py::test_x[a]@split-a",
    "tests/e2e/test_split.py::test_x[b]@split-b",
    "tests/e2e/test_split.py::test_y[a@b]",
    "tests/api/test_small.py::test_only",
]


def scheduled(seconds: dict[str, float]) -> tuple[LongestFirstScopeScheduling, list[FakeWorker]]:
    scheduler = LongestFirstScopeScheduling(FakeConfig(), seconds=seconds)
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, COLLECTION)
    scheduler.schedule()
    return scheduler, workers


def sent_scopes(worker: FakeWorker) -> list[str]:
    scopes = []
    for index in worker.sent:
        scope = scope_of(COLLECTION[index])
        if scope not in scopes:
            scopes.append(scope)
    return scopes


def test_groups_and_modules_are_the_units():
    assert scope_of("tests/e2e/test_split.py::test_x[a]@split-a") == "split-a"
    assert scope_of("tests/e2e/test_split.py::test_y[a@b]") == "tests/e2e/test_split.py"  # an "@" in a parameter id
    assert scope_of("tests/core/test_many.py::TestClass::test_0") == "tests/core/test_many.py::TestClass"


def test_the_longest_units_go_out_first():
    seconds = {"tests/e2e/test_server.py": 300.0, "split-a": 120.0, "split-b": 110.0, "tests/core/test_many.py": 2.0}
    scheduler, (first, second) = scheduled(seconds)
    # xdist gives each worker a second unit while its first has two tests or fewer left;
    # the unrecorded server module is estimated at a minute
    assert sent_scopes(first) == ["tests/e2e/test_server.py", "split-b"]
    assert sent_scopes(second) == ["split-a", "tests/e2e/test_split.py"]
    assert list(scheduler.workqueue) == ["tests/core/test_many.py", "tests/api/test_small.py"]


def test_a_unit_missing_from_the_record_gets_an_estimate():
    assert estimated_seconds("tests/e2e/test_new.py", ["tests/e2e/test_new.py::a"], {}) == 60.0  # a server module
    assert estimated_seconds("new-group", ["tests/e2e/test_new.py::a@new-group"], {}) == 60.0
    assert estimated_seconds("tests/core/test_new.py", ["a"] * 20, {}) == 1.0
    assert estimated_seconds("tests/core/test_new.py", ["a"], {"tests/core/test_new.py": 7.5}) == 7.5
    # nothing recorded: the server modules still go before the quick ones
    _, (first, second) = scheduled({})
    assert {sent_scopes(first)[0], sent_scopes(second)[0]} <= {
        "tests/e2e/test_server.py",
        "split-a",
        "split-b",
        "tests/e2e/test_split.py",
    }


def test_every_test_is_sent_exactly_once():
    scheduler, workers = scheduled({"tests/e2e/test_server.py": 300.0})
    while scheduler.workqueue or any(scheduler._pending_of(scheduler.assigned_work[w]) for w in workers):
        for worker in workers:
            pending = [
                i for i in worker.sent if not scheduler.assigned_work[worker][scope_of(COLLECTION[i])][COLLECTION[i]]
            ]
            if pending:
                scheduler.mark_test_complete(worker, pending[0])
    sent = sorted(index for worker in workers for index in worker.sent)
    assert sent == list(range(len(COLLECTION)))


def test_the_recorder_sums_each_unit(tmp_path):
    class Report:
        def __init__(self, nodeid, duration):
            self.nodeid, self.duration = nodeid, duration

    path = tmp_path / "seconds.json"
    recorder = SecondsRecorder(str(path))
    for nodeid, duration in [
        ("tests/e2e/test_server.py::test_one", 10.0),
        ("tests/e2e/test_server.py::test_two", 2.5),
        ("tests/e2e/test_split.py::test_x[a]@split-a", 4.0),
        ("tests/api/test_small.py::test_only", 0.01),
    ]:
        recorder.pytest_runtest_logreport(Report(nodeid, duration))
    recorder.pytest_sessionfinish(None)
    recorded = json.loads(path.read_text())
    assert recorded == {"tests/e2e/test_server.py": 12.5, "split-a": 4.0, "tests/api/test_small.py": 0.0}
    assert list(recorded) == ["tests/e2e/test_server.py", "split-a", "tests/api/test_small.py"]


def test_units_with_a_slow_test_are_estimated_as_server_modules():
    class Item:
        def __init__(self, nodeid, slow):
            self.nodeid, self.slow = nodeid, slow

        def get_closest_marker(self, name):
            return object() if name == "slow" and self.slow else None

    config = FakeConfig()
    directory = slow_units_dir(config)
    items = [
        Item("tests/core/test_grid.py::test_quick", False),
        Item("tests/core/test_grid.py::test_real_model", True),
        Item("tests/core/test_many.py::test_0", False),
    ]
    write_slow_units({"xdist_slow_units_dir": directory, "workerid": "gw0"}, items)
    write_slow_units({"workerid": "gw1"}, items)  # not under loadscope: nothing to write
    assert read_slow_units(config) == {"tests/core/test_grid.py"}
    assert estimated_seconds("tests/core/test_grid.py", ["a", "b"], {}, read_slow_units(config)) == 60.0
    assert estimated_seconds("tests/core/test_many.py", ["a"], {}, read_slow_units(config)) == 0.05
    remove_slow_units_dir(config)
    assert not os.path.exists(directory)
