"""The CPU kernel levels this host runs, as a module-scoped fixture: a test module that uses
``isa_level`` runs once per level (on an AVX-512 host: avx512, avx2 and generic), the process
switched to that level's operators (:func:`tokenloom.kernels.cpu_native.using_level`) while it
runs. A level whose library does not build here is skipped with the reason, or fails the run
under ``TOKENLOOM_CPU_KERNELS=require`` (what ``make test`` sets). A test of such a module whose
code is torch's own (no native operator on its path) runs once, at the host's own level
(:func:`at_the_host_level`, :func:`once_and_per_level`): repeating it per level checks nothing more."""

from __future__ import annotations

import pytest

from tokenloom.kernels import cpu_native

# with the kernels switched off there is one pass, on the torch paths; else the host's own
# level first (host_levels lists the best first)
LEVELS = [level.name for level in cpu_native.host_levels()] if cpu_native.enabled() else ["off"]


def at_the_host_level():
    """A mark for a test, in a module that runs per level, whose code is torch's own (the same at
    every level): it runs once, at the host's own level, instead of once per level."""
    return pytest.mark.parametrize("isa_level", LEVELS[:1], indirect=True)


def once_and_per_level(argname: str, level_free, per_level, ids: tuple[str, str]):
    """A mark parametrizing ``argname`` over a torch path and a native one, in a module that runs
    per level: ``level_free`` (torch code, the same at every level) once, at the host's own level;
    ``per_level`` at every level. (Module scope: the tests of a level still run together.)"""
    params = [
        pytest.param(level_free, LEVELS[0], id=ids[0]),
        *(pytest.param(per_level, level, id=f"{ids[1]}-{level}") for level in LEVELS),
    ]
    return pytest.mark.parametrize(f"{argname}, isa_level", params, indirect=["isa_level"], scope="module")


@pytest.fixture(scope="module", params=LEVELS)
def isa_level(request):
    if request.param == "off":
        yield request.param
        return
    level = cpu_native.LEVELS_BY_NAME[request.param]
    if cpu_native.load_level(level) is None:
        message = f"the {level.name} kernels did not build or load here: {cpu_native.failure(level)}"
        if cpu_native.mode() == "require":
            pytest.fail(message)
        pytest.skip(message)
    with cpu_native.using_level(level.name):
        yield level.name
