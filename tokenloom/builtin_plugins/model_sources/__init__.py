"""model_sources."""
