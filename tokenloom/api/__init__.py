"""The OpenAI-compatible server and the command line, assembled from the registries."""
