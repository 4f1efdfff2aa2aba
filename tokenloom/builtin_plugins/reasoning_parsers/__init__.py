"""reasoning_parsers."""
