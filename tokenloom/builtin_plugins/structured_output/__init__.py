"""structured_output."""
