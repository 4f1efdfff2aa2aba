"""Built-in KV connectors: ``SharedStorageConnector`` (KV blocks in a directory, shared by
restarts and by a prefill and a decode instance)."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_kv_connectors(register):
    register("SharedStorageConnector", "tokenloom.builtin_plugins.kv_connectors.shared_storage:SharedStorageConnector")
