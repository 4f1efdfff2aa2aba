"""The CPU kernel levels this host runs, as a module-scoped fixture: a test module that uses
``isa_level`` runs once per level (on an AVX-512 host: avx512, avx2 and generic), the process
switched to that level's operators (:func:`tokenloom.kernels.cpu_native.using_level`) while it
runs. A level whose library does not build here is skipped with the reason, or fails the run
under ``TOKENLOOM_CPU_KERNELS=require`` (what ``make test`` sets)."""

from __future__ import annotations

import pytest

from tokenloom.kernels import cpu_native

# with the kernels switched off there is one pass, on the torch paths
LEVELS = [level.name for level in cpu_native.host_levels()] if cpu_native.enabled() else ["off"]


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
