"""The profile run of a model that sees (issue 35): on a platform that profiles activations the
engine hands the worker its processor's worst-case image, and the profile run encodes it before
the largest step, so the peak the platform measures grows with the largest image the processor
keeps. The fake platform is the CPU one told to profile; its "peak" is the largest tensor any
operation of the profile run made (the CPU has no allocator statistics)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.idefics3_checkpoint import write_tiny_idefics3
from torch.utils._python_dispatch import TorchDispatchMode

from tokenloom import LLM
from tokenloom.builtin_plugins.platforms.cpu import CpuPlatform
from tokenloom.core.model_runner import ModelRunner


class LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any operation makes while it is on."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, tensor.numel() * tensor.element_size())
        return result


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_gguf):
    """The tiny SmolVLM twice: images resized to a 64-pixel longest edge (2 x 2 tiles and the
    global image) and to a 192-pixel one (6 x 6 tiles), the weights the same."""
    small = tmp_path_factory.mktemp("smolvlm-64")
    write_tiny_idefics3(small, smollm2_gguf)
    large = tmp_path_factory.mktemp("smolvlm-192")
    shutil.copytree(small, large, dirs_exist_ok=True)
    config_path = large / "processor_config.json"
    processor_config = json.loads(config_path.read_text())
    processor_config["image_processor"]["size"] = {"longest_edge": 192}
    config_path.write_text(json.dumps(processor_config))
    return str(small), str(large)


def profile(model: str, monkeypatch) -> tuple[int, list[int]]:
    """Start an engine on a CPU platform that profiles: the largest tensor of its profile run
    and the frames of each image it encoded there."""
    runs: list[LargestTensor] = []
    frames: list[int] = []
    profile_run = ModelRunner.profile_run

    def measured_profile_run(runner):
        embed_multimodal = runner.model.embed_multimodal

        def recording_embed(item, backend):
            frames.append(item.data["pixel_values"].shape[0])
            return embed_multimodal(item, backend)

        runner.model.embed_multimodal = recording_embed
        with LargestTensor() as mode:
            runs.append(mode)
            try:
                return profile_run(runner)
            finally:
                del runner.model.embed_multimodal

    monkeypatch.setattr(CpuPlatform, "profiles_activations", True)
    monkeypatch.setattr(ModelRunner, "profile_run", measured_profile_run)
    llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_batched_tokens=64)
    llm.engine.shutdown()
    monkeypatch.undo()
    (run,) = runs
    return run.largest_bytes, frames


def test_the_profile_run_encodes_the_worst_case_image_and_its_peak_grows_with_it(checkpoints, monkeypatch):
    small_peak, small_frames = profile(checkpoints[0], monkeypatch)
    large_peak, large_frames = profile(checkpoints[1], monkeypatch)
    assert small_frames == [5]  # 2 x 2 tiles and the global image
    assert large_frames == [37]  # 6 x 6 tiles and the global image
    assert large_peak > small_peak
