#!/bin/bash
# Issue 21 (what -tp/-pp/-dp cost and buy on a 2-core machine), issue 23 (n-gram speculation
# after the verify step became decode rows) and issue 22 (LoRA on the fused layer), one server at
# a time on a quiet machine: bash benchmarks/s9_sitting.sh [OUT] (results in benchmarks/results/).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/2026-11-26-s9}
TL=.venv/bin/tokenloom
mkdir -p $OUT
grep -o -w 'avx2\|avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | paste -sd ' ' > $OUT/cpu_flags.txt
wait_ready() { for i in $(seq 1 600); do curl -sf localhost:8000/health >/dev/null && return 0; sleep 1; done; return 1; }
run() { # label c n extra...
  local label=$1 c=$2 n=$3; shift 3
  $TL bench serve --base-url http://127.0.0.1:8000 --model smollm2 --dataset-name random --random-input-len 256 \
    --random-output-len 128 --ignore-eos --temperature 0 --max-concurrency $c --num-prompts $n --num-warmups 1 \
    --disable-tqdm --save-result --result-dir $OUT --result-filename $label.json --label $label "$@" 2>&1 \
    | grep -E "Output token throughput|Mean TPOT|Mean TTFT" | tr -s ' ' | paste -sd ' ' | sed "s/^/$label: /"
}
rewrite() { # label
  $TL bench serve --base-url http://127.0.0.1:8000 --model smollm2 --dataset-name sharegpt \
    --dataset-path benchmarks/spec_decode_rewrite.json --num-prompts 4 --max-concurrency 1 --temperature 0 \
    --num-warmups 1 --disable-tqdm --save-result --result-dir $OUT --result-filename $1.json --label $1 2>&1 \
    | grep -E "Output token throughput|Mean TPOT|Mean TTFT" | tr -s ' ' | paste -sd ' ' | sed "s/^/$1: /"
}
serve() { # label flags...
  local label=$1; shift
  local start=$(date +%s.%N)
  $TL serve smollm2 "$@" > $OUT/$label-server.log 2>&1 &
  PID=$!
  wait_ready || { echo "$label: server not ready"; tail -5 $OUT/$label-server.log; }
  echo "$label: ready in $(echo "$(date +%s.%N) - $start" | bc) s"
}
stop() { kill $PID; wait $PID 2>/dev/null; sleep 2; }
pair() { run $1-c1 1 8; run $1-c32 32 64; }

uni() { serve uni; pair uni; rewrite uni-rewrite; stop; }
# -tp 3 runs 3 single-threaded workers on 2 cores: a c=1 step takes ~200 ms
tp3() { serve tp3 -tp 3; pair tp3; stop; }
tp3c32() { serve tp3 -tp 3; run tp3-c32 32 64; stop; }
pp2() { serve pp2 -pp 2; pair pp2; stop; }
dp2() { serve dp2 -dp 2; pair dp2; stop; }
ngram() {
  serve ngram --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
  rewrite ngram-rewrite; run ngram-random-c1 1 8
  curl -s localhost:8000/metrics | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total"
  stop
}
lora() {
  [ -d /tmp/adapters/a4 ] || .venv/bin/python benchmarks/make_lora_adapters.py /tmp/adapters 4
  serve lora --enable-lora --max-loras 4 --max-lora-rank 16 \
    --lora-modules a1=/tmp/adapters/a1 a2=/tmp/adapters/a2 a3=/tmp/adapters/a3 a4=/tmp/adapters/a4
  for c in 1 32; do n=$(( c == 1 ? 8 : 64 ))
    run lora-base-c$c $c $n
    run lora-1adapter-c$c $c $n --lora-modules a1
    run lora-4adapters-c$c $c $n --lora-modules a1 a2 a3 a4
  done
  stop
}
# sections to run (default: all), e.g. bash benchmarks/s9_sitting.sh OUT ngram lora
shift || true
for section in ${@:-uni tp3 pp2 dp2 ngram lora}; do $section; done
