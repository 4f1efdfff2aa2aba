"""nn.Module building blocks for model plugins (the model SDK)."""
