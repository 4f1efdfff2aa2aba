"""The plugin system: hook specifications, discovery and typed registries."""
