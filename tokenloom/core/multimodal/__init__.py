"""Images in, text out: what a multimodal request carries through the engine
(:mod:`.inputs`), the processor interface a model plugin that sees implements
(:mod:`.processor`), and the worker's encoder cache (:mod:`.encoder_cache`)."""
