"""Image encode time of LLaVA-1.5's vision side (CLIP tower to the feature layer, then the
projector) in tokenloom against transformers, on random weights of a real shape: one image
per call, best and median of ``--repeats`` after a warm-up.

    python benchmarks/vision_encode.py --shape vit-l-336   # LLaVA-1.5's ViT-L/14 at 336 px
    python benchmarks/vision_encode.py --shape vit-b-224   # a smaller tower, for a quick look

The language model is cut to one small layer (its size does not change the encode time); the
projector maps to 4096 features as LLaVA-1.5-7B's does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {
    # hidden, intermediate, layers, heads, image size, patch
    "vit-l-336": (1024, 4096, 24, 16, 336, 14),
    "vit-b-224": (768, 3072, 12, 12, 224, 16),
}


def timed(function, repeats: int) -> list[float]:
    function()  # warm-up: kernels built, caches filled
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vit-b-224")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from tokenloom.builtin_plugins.models.modeling_llava import LlavaForConditionalGeneration as Ours
    from tokenloom.core.model_interface import ModelContext
    from tokenloom.core.multimodal.inputs import MultiModalItem
    from tokenloom.kernels.paged_attention import NativeCpuPagedAttention

    hidden, intermediate, layers, heads, image_size, patch = SHAPES[args.shape]
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=image_size,
        patch_size=patch,
    )
    text = LlamaConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=256, num_hidden_layers=1, num_attention_heads=32
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=1000)
    torch.manual_seed(0)
    hf_model = LlavaForConditionalGeneration(config).eval()
    ours = Ours(ModelContext(hf_config=config, dtype=torch.float32, device=torch.device("cpu")))
    ours.load_weights(hf_model.state_dict().items())
    pixel_values = torch.randn(3, image_size, image_size)
    num_features = (image_size // patch) ** 2
    item = MultiModalItem("image", "0" * 64, 0, num_features, {"pixel_values": pixel_values})
    backend = NativeCpuPagedAttention()
    with torch.inference_mode():
        ours_seconds = timed(lambda: ours.embed_multimodal(item, backend), args.repeats)
        hf_seconds = timed(lambda: hf_model.model.get_image_features(pixel_values[None]), args.repeats)
    print(f"{args.shape}: {num_features} image tokens, {torch.get_num_threads()} threads, float32")
    for name, seconds in (("tokenloom", ours_seconds), ("transformers", hf_seconds)):
        print(f"  {name:>12}: best {min(seconds) * 1000:.1f} ms, median {statistics.median(seconds) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
