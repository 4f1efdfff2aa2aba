"""The minimal core: scheduler, KV block manager, executor interface, model runner, sampler,
detokenizer and engine. It names no concrete model, format, parser or device."""
