"""The built-in device platforms (``cpu``, ``cuda``) and the attention backends they run,
registered as ``"module:Class"`` strings: loading this plugin imports neither platform."""

from tokenloom.plugin_api import hookimpl

PACKAGE = "tokenloom.builtin_plugins.platforms"


@hookimpl
def register_platforms(register):
    register("cpu", f"{PACKAGE}.cpu:CpuPlatform")
    register("cuda", f"{PACKAGE}.cuda:CudaPlatform")


@hookimpl
def register_attention_backends(register):
    # torch's ops run on any device; the reference is the plain definition the others are
    # tested against; cpu_native is tokenloom's C++ kernels (vLLM's CPU backend is CPU_ATTN);
    # triton runs on the CPU too under TRITON_INTERPRET=1 (slow: for testing the kernels)
    register("torch", "tokenloom.kernels.paged_attention:TorchPagedAttention", aliases=("torch_sdpa",))
    register("cpu_native", "tokenloom.kernels.paged_attention:NativeCpuPagedAttention", aliases=("cpu_attn",))
    register("reference", "tokenloom.kernels.paged_attention:ReferencePagedAttention")
    register(
        "triton",
        "tokenloom.kernels.triton.attention:TritonPagedAttention",
        aliases=("triton_attn", "triton_attn_vllm_v1"),
    )
