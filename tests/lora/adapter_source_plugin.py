"""A third-party model source that ships LoRA adapters: ``test-adapters:NAME`` resolves to the
folder registered in ``ADAPTER_FOLDERS`` (loaded in tests with ``LLM(plugins=[this module])``)."""

from __future__ import annotations

from tokenloom.plugin_api import ModelLoadError, ModelSource, ResolvedModel, hookimpl

PREFIX = "test-adapters:"
ADAPTER_FOLDERS: dict[str, str] = {}


class PackagedAdapterSource(ModelSource):
    def matches(self, model: str) -> bool:
        return model.startswith(PREFIX)

    def resolve(self, model, *, revision=None, download_dir=None) -> ResolvedModel:
        name = model[len(PREFIX) :]
        if name not in ADAPTER_FOLDERS:
            raise ModelLoadError(f"no packaged adapter {name!r}; known: {', '.join(sorted(ADAPTER_FOLDERS))}")
        return ResolvedModel(path=ADAPTER_FOLDERS[name], name=name, source="test_adapters")


@hookimpl
def register_model_sources(register):
    register("test_adapters", "tests.lora.adapter_source_plugin:PackagedAdapterSource")
