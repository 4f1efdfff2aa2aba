"""tool_parsers."""
