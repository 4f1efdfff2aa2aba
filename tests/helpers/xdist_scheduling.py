"""How `make test` (``pytest -n 2 --dist loadscope``) shares the suite between its workers.

xdist's loadscope keeps a module's tests in one worker (so a module-scoped server starts once)
but hands modules out by their number of tests, most first: the long real-model modules, a few
tests each, came last and one worker ran them alone while the other sat idle. Here the work
units go out longest first, by the seconds each took in a recorded run (tests/xdist_seconds.json),
so the short ones fill in at the end on whichever worker frees up.

A module may also be cut into several units (e.g. one per half of its server set) by marking
tests ``@pytest.mark.xdist_group("name")``: the tests of a group stay in one worker, as under
``--dist loadgroup``, while unmarked tests keep loadscope's grouping by module.

Refresh the recorded seconds after adding or changing slow modules (a unit missing from the
file gets an estimate, so a stale file only costs balance, never a test):
``pytest -n 2 --dist loadscope --record-xdist-seconds``."""

from __future__ import annotations

import json
import os
from collections import OrderedDict, defaultdict

import pytest
from xdist.scheduler import LoadScopeScheduling

SECONDS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xdist_seconds.json")
# a unit missing from the recorded seconds: modules that start a server or hold a test marked
# `slow` (a real model) take about a minute, the others a fraction of a second a test
UNKNOWN_SERVER_MODULE_SECONDS = 60.0
UNKNOWN_SECONDS_PER_TEST = 0.05


def group_of(nodeid: str) -> str | None:
    """The ``xdist_group`` a test was put in (added to its node id as ``@name``), if any."""
    # a parameter's id may hold an "@": the group suffix comes after the last "]"
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[1]
    return None


def scope_of(nodeid: str) -> str:
    """The work unit of a test: its xdist group, else its module (or class), as loadscope."""
    group = group_of(nodeid)
    if group is not None:
        return group
    return nodeid.rsplit("::", 1)[0]


# the controller's directory where each worker lists the units holding a test marked `slow`
SLOW_UNITS_DIR = pytest.StashKey[str]()


def slow_units_dir(config) -> str:
    if SLOW_UNITS_DIR not in config.stash:
        import tempfile

        config.stash[SLOW_UNITS_DIR] = tempfile.mkdtemp(prefix="tokenloom-xdist-")
    return config.stash[SLOW_UNITS_DIR]


def remove_slow_units_dir(config) -> None:
    if SLOW_UNITS_DIR in config.stash:
        import shutil

        shutil.rmtree(config.stash[SLOW_UNITS_DIR], ignore_errors=True)


def write_slow_units(workerinput: dict, items) -> None:
    """In a worker, before it reports its collection: the units holding a test marked `slow`."""
    directory = workerinput.get("xdist_slow_units_dir")
    if directory is None:
        return
    units = sorted({scope_of(item.nodeid) for item in items if item.get_closest_marker("slow") is not None})
    with open(os.path.join(directory, f"{workerinput['workerid']}.json"), "w") as handle:
        json.dump(units, handle)


def read_slow_units(config) -> set[str]:
    if SLOW_UNITS_DIR not in config.stash:
        return set()
    units: set[str] = set()
    for name in os.listdir(config.stash[SLOW_UNITS_DIR]):
        with open(os.path.join(config.stash[SLOW_UNITS_DIR], name)) as handle:
            units.update(json.load(handle))
    return units


def load_seconds(path: str = SECONDS_FILE) -> dict[str, float]:
    try:
        with open(path) as handle:
            return {str(scope): float(seconds) for scope, seconds in json.load(handle).items()}
    except FileNotFoundError:
        return {}


def estimated_seconds(scope: str, nodeids, recorded: dict[str, float], slow_units=frozenset()) -> float:
    if scope in recorded:
        return recorded[scope]
    if scope in slow_units or any(nodeid.startswith("tests/e2e/") for nodeid in nodeids):
        return UNKNOWN_SERVER_MODULE_SECONDS
    return UNKNOWN_SECONDS_PER_TEST * len(nodeids)


class LongestFirstScopeScheduling(LoadScopeScheduling):
    """loadscope, with its units handed out longest first and ``xdist_group`` marks honoured."""

    def __init__(self, config, log=None, seconds: dict[str, float] | None = None):
        super().__init__(config, log)
        self.seconds = load_seconds() if seconds is None else seconds
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        # the queue is filled (in collection order) just before the first assignment
        if not self._ordered:
            slow_units = read_slow_units(self.config)
            units = sorted(
                self.workqueue.items(), key=lambda unit: -estimated_seconds(unit[0], unit[1], self.seconds, slow_units)
            )
            self.workqueue = OrderedDict(units)
            self._ordered = True
        super()._assign_work_unit(node)


class SecondsRecorder:
    """Sums each unit's setup, call and teardown seconds in the controller and writes them to
    :data:`SECONDS_FILE` at the end of the run."""

    def __init__(self, path: str = SECONDS_FILE):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[scope_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        ordered = dict(sorted(((scope, round(s, 1)) for scope, s in self.seconds.items()), key=lambda kv: -kv[1]))
        with open(self.path, "w") as handle:
            json.dump(ordered, handle, indent=1)
            handle.write("\n")
