"""LoRA adapters served beside one base model: the request type (:mod:`.request`), PEFT
adapter files read and checked (:mod:`.peft`), the per-layer slot buffers and batched delta
(:mod:`.layers`) and the worker's slots and LRU cache (:mod:`.manager`)."""
