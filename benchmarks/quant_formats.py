"""The quantized-formats sitting: SmolLM2-135M-Instruct in each format tokenloom serves natively,
against the peer that serves the same file (vLLM CPU for compressed-tensors, llama.cpp's
llama-server for GGUF), one server at a time, each measured with vLLM's own client.

    python benchmarks/quant_formats.py make DIR
    python benchmarks/quant_formats.py sit DIR OUT [--formats w8a8 q4_k_m ...] [--servers tokenloom peer]

``make`` writes, once (an existing file is kept), under DIR:

- ``w8a8/`` and ``w4a16/``: compressed-tensors checkpoints written by ``llmcompressor``, data-free
  (round to nearest; W8A8's activations are quantized per token at run time, so nothing needs
  calibrating): W8A8 int8 (channel weights, dynamic per-token activations) and W4A16
  (pack-quantized, symmetric, groups of :data:`W4A16_GROUP_SIZE`). llmcompressor runs in its own
  venv (``--llmc-python``; it is not a tokenloom dependency):
  ``python3 -m venv /work/peer/venv-llmc && /work/peer/venv-llmc/bin/pip install torch==2.13.0 llmcompressor``.
- ``f16.gguf`` by llama.cpp's ``convert_hf_to_gguf.py`` (``--convert``, run by ``--convert-python``,
  a Python with ``torch``, ``transformers`` and ``gguf``, e.g. vLLM's peer venv), and from it
  ``q8_0.gguf`` ... ``q3_k_m.gguf`` by ``llama-quantize`` (:data:`GGUF_TYPES`).

The dense source (``--hf-dir``) is ``../shared/bench/peer.sh setup``'s HF copy of SmolLM2-135M-Instruct:
a full checkpoint (config, tokenizer, every tensor), in bfloat16, whose values are the packaged Q4_1
GGUF's dequantized, not the original release's. The formats' speed and size do not depend on that.

``sit`` serves each format with tokenloom, then with its peer (or the servers ``--servers`` names,
in that order; a name may repeat on a noisy machine), and for each prints one row: the file's
size, the KV cache the server allocated (tokenloom's and vLLM's 4 GiB by default, llama-server's
for its 32 slots of 512 tokens), time to ready (process start to a 200 from /health), peak RSS (the
sum of VmHWM over the server's processes: vLLM serves from three), and per concurrency of
``PAIRS`` (peer.sh's, default "1:8 32:64") the median TPOT and the output throughput. The client's
JSON and logs and each server's log go to OUT. vLLM compiles its model on a first start (minutes on
2 cores; cached under ~/.cache/vllm): its time to ready is a warm one from the second start on.
The machine has 2 cores: nothing else heavy may run during a sitting.
Env: PEER_DIR (default /work/peer), TOKENLOOM (default the repository's .venv/bin/tokenloom),
LLAMA_SERVER (default PEER_DIR's llama.cpp-src/build/bin/llama-server; on a CPU whose AMX build
crashes, the no-AMX build of benchmarks/big_model_sitting.sh),
LLAMA_SLOTS (32), LLAMA_CONTEXT (16384), VLLM_CPU_KVCACHE_SPACE (GiB, default 4, as peer.sh's).

This file imports nothing beyond the standard library at its top: ``compress`` (what ``make``
runs for each compressed-tensors format) is run by llmcompressor's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_DIR = Path(os.environ.get("PEER_DIR", "/work/peer"))
# ../shared/bench/peer.sh beside the main checkout; from a worktree elsewhere, its usual place
PEER_SH = next(
    (path for path in (HERE.parent.parent / "shared" / "bench" / "peer.sh",) if path.exists()),
    Path("/work/shared/bench/peer.sh"),
)
SERVED_NAME = "m"
TOKENLOOM_PORT, PEER_PORT = 8400, 8300

# SmolLM2-135M's hidden size (576) is not a multiple of 128: groups of 128 would split its q/k/v and
# gate/up input features unevenly, which neither tokenloom nor vLLM serves; 64 divides 576 and 1536
W4A16_GROUP_SIZE = 64
COMPRESSED_FORMATS = ("w8a8", "w4a16")
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M")
FORMATS = COMPRESSED_FORMATS + tuple(kind.lower() for kind in GGUF_TYPES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


# -- make ----------------------------------------------------------------------------------------


def compress(hf_dir: str, out_dir: str, scheme: str) -> None:
    """Write ``scheme``'s compressed-tensors checkpoint of ``hf_dir`` to ``out_dir`` with
    llmcompressor (run in its venv)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto")
    if scheme == "w8a8":
        recipe = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": W4A16_GROUP_SIZE}
        recipe = QuantizationModifier(
            config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"]
        )
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(out_dir, save_compressed=True)
    for name in TOKENIZER_FILES:
        if (Path(hf_dir) / name).exists():
            shutil.copy(Path(hf_dir) / name, Path(out_dir) / name)


def make(args: argparse.Namespace) -> None:
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for scheme in COMPRESSED_FORMATS:
        target = out / scheme
        if (target / "config.json").exists():
            continue
        print(f"{scheme}: llmcompressor", flush=True)
        partial = out / f"{scheme}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        command = [args.llmc_python, __file__, "compress", args.hf_dir, str(partial), scheme]
        subprocess.run(command, check=True)
        partial.rename(target)
    f16 = out / "f16.gguf"
    if not f16.exists():
        print("f16.gguf: convert_hf_to_gguf.py", flush=True)
        partial_f16 = out / "f16.gguf.partial"
        command = [args.convert_python, args.convert, args.hf_dir, "--outtype", "f16", "--outfile", str(partial_f16)]
        subprocess.run(command, check=True)
        partial_f16.rename(f16)
    for kind in GGUF_TYPES:
        target = out / f"{kind.lower()}.gguf"
        if target.exists():
            continue
        print(f"{target.name}: llama-quantize", flush=True)
        partial_gguf = out / f"{target.name}.partial"
        subprocess.run([args.llama_quantize, str(f16), str(partial_gguf), kind], check=True, capture_output=True)
        partial_gguf.rename(target)
    for path in sorted(out.iterdir()):
        print(f"{path.name}: {size_bytes(path) / 2**20:.1f} MiB")


# -- sit -----------------------------------------------------------------------------------------


def size_bytes(path: Path) -> int:
    """A GGUF file's size, or the weights' of a checkpoint directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(part.stat().st_size for part in path.glob("*.safetensors"))


def model_path(directory: Path, fmt: str) -> Path:
    return directory / fmt if fmt in COMPRESSED_FORMATS else directory / f"{fmt}.gguf"


def server_command(server: str, fmt: str, path: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``server`` ("tokenloom" or "peer") serving ``path``."""
    env = dict(os.environ)
    if server == "tokenloom":
        tokenloom = os.environ.get("TOKENLOOM", str(HERE.parent / ".venv" / "bin" / "tokenloom"))
        return [tokenloom, "serve", str(path), "--served-model-name", SERVED_NAME, "--port", str(TOKENLOOM_PORT)], env
    if fmt in COMPRESSED_FORMATS:
        # both cores for compute, as peer.sh serve-vllm; its KV cache is the space it is given
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        vllm = str(PEER_DIR / "venv-vllm" / "bin" / "vllm")
        command = [vllm, "serve", str(path), "--served-model-name", SERVED_NAME, "--dtype", "bfloat16"]
        return command + ["--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(PEER_PORT)], env
    llama_server = os.environ.get("LLAMA_SERVER", str(PEER_DIR / "llama.cpp-src" / "build" / "bin" / "llama-server"))
    command = [llama_server, "-m", str(path), "-a", SERVED_NAME, "-t", "2", "-tb", "2"]
    command += ["-c", os.environ.get("LLAMA_CONTEXT", "16384"), "-np", os.environ.get("LLAMA_SLOTS", "32")]
    return command + ["-cb", "--no-kv-unified", "--host", "127.0.0.1", "--port", str(PEER_PORT)], env


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def process_tree(pid: int) -> list[int]:
    """``pid`` and its living descendants (vLLM's engine core and worker, tokenloom's engine)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def peak_rss_bytes(pid: int) -> tuple[int, int]:
    """``(sum of VmHWM over the server's processes, how many)``: each process's own peak, so
    an upper bound when the peaks fell at different times, or pages are shared between them."""
    total, count = 0, 0
    for member in process_tree(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total, count = total + int(line.split()[1]) * 1024, count + 1
    return total, count


def llama_server_kv_mib(gguf_path: Path) -> float:
    """llama-server's f16 KV cache for LLAMA_CONTEXT tokens of this GGUF's shape (it logs the size
    only at a verbosity that logs every step too)."""
    import gguf  # tokenloom's venv has it; only this server's row needs it

    reader = gguf.GGUFReader(str(gguf_path))
    architecture = reader.fields["general.architecture"].contents()

    def field(key: str) -> int:
        return int(reader.fields[f"{architecture}.{key}"].contents())

    head_dim = field("embedding_length") // field("attention.head_count")
    per_token = field("block_count") * 2 * field("attention.head_count_kv") * head_dim * 2  # K and V, f16
    return per_token * int(os.environ.get("LLAMA_CONTEXT", "16384")) / 2**20


def kv_cache_mib(server: str, fmt: str, path: Path, log: str) -> float | None:
    """The KV cache the server allocated: tokenloom's from its log, vLLM CPU's the space it was
    given, llama-server's from the file's shape."""
    if server == "peer" and fmt in COMPRESSED_FORMATS:
        return float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")) * 1024
    if server == "peer":
        return llama_server_kv_mib(path)
    sizes = [float(match) for match in re.findall(r"KV cache: .*\(([\d.]+) MiB\)", log)]
    return sum(sizes) if sizes else None


def bench_columns(out_prefix: Path) -> str:
    """Per concurrency of PAIRS: median TPOT (ms) and output throughput (tok/s) from the client's JSON."""
    columns = []
    for pair in os.environ.get("PAIRS", "1:8 32:64").split():
        concurrency = pair.split(":")[0]
        result_file = out_prefix.parent / f"{out_prefix.name}_c{concurrency}.json"
        if not result_file.exists():
            columns.append(f"c={concurrency}: no result")
            continue
        result = json.loads(result_file.read_text())
        tpot, throughput = result["median_tpot_ms"], result["output_throughput"]
        columns.append(f"c={concurrency}: TPOT {tpot:.1f} ms, {throughput:.1f} tok/s")
    return " | ".join(columns)


def sit_one(server: str, fmt: str, path: Path, out: Path, run: int) -> str:
    """Serve ``path`` with ``server``, bench it, stop it; the table row."""
    name = f"{fmt}-{server}-{run}"
    command, env = server_command(server, fmt, path)
    port = TOKENLOOM_PORT if server == "tokenloom" else PEER_PORT
    log_path = out / f"{name}.server.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while not healthy(port):
            if process.poll() is not None:
                return f"{fmt:7} {server:9} exited with {process.returncode} before ready; see {log_path}"
            time.sleep(0.2)
        ready = time.monotonic() - started
        bench_env = {**os.environ, "PEER_DIR": str(PEER_DIR), "MODEL": SERVED_NAME}
        bench_env.setdefault("PAIRS", "1:8 32:64")
        subprocess.run(["bash", str(PEER_SH), "bench", f"http://127.0.0.1:{port}", str(out / name)], env=bench_env)
        rss, processes = peak_rss_bytes(process.pid)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    kv = kv_cache_mib(server, fmt, path, log_path.read_text(errors="replace"))
    kv_text = "?" if kv is None else f"{kv:.0f}"
    return (
        f"{fmt:7} {server:9} file {size_bytes(path) / 2**20:6.1f} MiB | KV {kv_text:>5} MiB | ready {ready:5.1f} s | "
        f"peak RSS {rss / 2**20:7.1f} MiB ({processes} processes) | {bench_columns(out / name)}"
    )


def sit(args: argparse.Namespace) -> None:
    directory, out = Path(args.dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in args.formats:
        path = model_path(directory, fmt)
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run `{sys.argv[0]} make {directory}` first")
    for fmt in args.formats:
        for run, server in enumerate(args.servers):
            print(sit_one(server, fmt, model_path(directory, fmt), out, run), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make_parser = commands.add_parser("make", help="write the formats' files under DIR (once)")
    make_parser.add_argument("dir")
    make_parser.add_argument("--hf-dir", default=str(PEER_DIR / "smollm2-135m-instruct-hf"))
    make_parser.add_argument("--llmc-python", default=str(PEER_DIR / "venv-llmc" / "bin" / "python"))
    make_parser.add_argument("--convert-python", default=str(PEER_DIR / "venv-vllm" / "bin" / "python"))
    make_parser.add_argument(
        "--convert",
        default=str(PEER_DIR / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"),
    )
    make_parser.add_argument(
        "--llama-quantize", default=str(PEER_DIR / "llama.cpp-src" / "build" / "bin" / "llama-quantize")
    )
    sit_parser = commands.add_parser("sit", help="serve and bench each format with tokenloom and its peer")
    sit_parser.add_argument("dir")
    sit_parser.add_argument("out")
    sit_parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    sit_parser.add_argument("--servers", nargs="+", choices=("tokenloom", "peer"), default=["tokenloom", "peer"])
    compress_parser = commands.add_parser("compress", help="(run by make in llmcompressor's venv)")
    compress_parser.add_argument("hf_dir")
    compress_parser.add_argument("out_dir")
    compress_parser.add_argument("scheme", choices=COMPRESSED_FORMATS)
    args = parser.parse_args()
    if args.command == "compress":
        compress(args.hf_dir, args.out_dir, args.scheme)
    elif args.command == "make":
        make(args)
    else:
        sit(args)


if __name__ == "__main__":
    main()
