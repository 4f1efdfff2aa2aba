#!/usr/bin/env bash
# One sitting on a model of the benchmark set (benchmarks/model_set.py): tokenloom, then llama.cpp's
# native llama-server, serving the same GGUF one at a time, each measured with vLLM's own client
# (../shared/bench/peer.sh bench: random 256 in / 128 out, ignore_eos, greedy). Prints each
# server's time to ready (process start to a 200 from /health), its peak RSS (VmHWM) and the
# client's summary lines; the client's JSON and logs go to OUT_DIR. Each server starts with the
# file read through the page cache just before, so that ready times the server's own start-up:
# a test run before a sitting can push the file out of the cache, and the server that starts
# first would then read it from disk while the second reads it from memory.
#
#   benchmarks/big_model_sitting.sh /work/peer/models/smollm2-1.7b-Q4_K_M.gguf /tmp/sitting [ORDER]
#
# ORDER (default "tokenloom llamaserver") may repeat a server (A B A) on a noisy machine.
# Env: PEER_DIR (peer.sh's; default /tmp/peer), PAIRS (default "1:4 8:16": concurrency:prompts),
# TOKENLOOM (default the repository's .venv/bin/tokenloom), LLAMA_SLOTS (default 32),
# LLAMA_CONTEXT (default 16384: 512 tokens a slot), LLAMA_ARGS (more llama-server flags),
# LLAMA_SERVER (default peer.sh's build). On a Sapphire Rapids VM with AMX, a GGML_NATIVE build's
# llama-server crashed (SIGSEGV in ggml_backend_amx_mul_mat) on every Q4_K_M file it repacked for
# AMX; a build with AMX off and AVX-512 (VNNI, BF16) on repacks and runs:
#   cmake -S llama.cpp-src -B llama.cpp-src/build-noamx -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
#     -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
#     -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF \
#     -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF && cmake --build llama.cpp-src/build-noamx --target llama-server
# The machine has 2 cores: nothing else heavy may run during a sitting.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gguf=${1:?GGUF file}; out=${2:?OUT_DIR}; order=${3:-tokenloom llamaserver}
export PEER_DIR=${PEER_DIR:-/tmp/peer} MODEL=m PAIRS=${PAIRS:-1:4 8:16}
tokenloom=${TOKENLOOM:-$here/../.venv/bin/tokenloom}
peer=$here/../../shared/bench/peer.sh
mkdir -p "$out"

ready_and_bench() {  # name port command...
  local name=$1 port=$2; shift 2
  cat "$gguf" >/dev/null
  local started; started=$(date +%s.%N)
  "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$name exited; see $out/$name.server.log"; return 1; }
    sleep 0.2
  done
  echo "$name: ready in $(echo "$(date +%s.%N) - $started" | bc) s"
  bash "$peer" bench "http://127.0.0.1:$port" "$out/$name" | sed "s/^/$name  /"
  echo "$name: peak RSS $(awk '/VmHWM/ {printf "%.2f GiB", $2 / 1048576}' "/proc/$pid/status")"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

for server in $order; do
  case $server in
  tokenloom) ready_and_bench tokenloom 8400 "$tokenloom" serve "$gguf" --served-model-name m --port 8400 ;;
  llamaserver) ready_and_bench llamaserver 8300 "${LLAMA_SERVER:-$PEER_DIR/llama.cpp-src/build/bin/llama-server}" -m "$gguf" \
      -a m -t 2 -tb 2 -c "${LLAMA_CONTEXT:-16384}" -np "${LLAMA_SLOTS:-32}" -cb --no-kv-unified \
      --host 127.0.0.1 --port 8300 ${LLAMA_ARGS:-} ;;
  *) echo "unknown server $server"; exit 2 ;;
  esac
done
