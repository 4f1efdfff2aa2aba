#!/bin/bash
# Issue 23 (n-gram speculation at c=1): plain and n-gram servers on the rewrite workload
# (benchmarks/spec_decode_rewrite.json) and the random 256/128 workload, one server at a time,
# on a quiet machine: bash benchmarks/s10_sitting.sh [OUT] [SECTION ...] (results in OUT).
# The spec_decode counters include the bench's test request and warm-up (the first prompt
# twice). benchmarks/spec_rewrite_steps.py counts the steps of each kind of the same requests.
# PORT and TL (the tokenloom command) may be set in the environment.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/2026-11-26-s10}
TL=${TL:-.venv/bin/tokenloom}
PORT=${PORT:-8000}
mkdir -p $OUT
grep -o -w 'avx2\|avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | paste -sd ' ' > $OUT/cpu_flags.txt
wait_ready() { for i in $(seq 1 600); do curl -sf localhost:$PORT/health >/dev/null && return 0; sleep 1; done; return 1; }
summary() { grep -E "Output token throughput|Mean TPOT|Mean TTFT" | tr -s ' ' | paste -sd ' ' | sed "s/^/$1: /"; }
random_c1() { # label
  $TL bench serve --base-url http://127.0.0.1:$PORT --model smollm2 --dataset-name random --random-input-len 256 \
    --random-output-len 128 --ignore-eos --temperature 0 --max-concurrency 1 --num-prompts 8 --num-warmups 1 \
    --disable-tqdm --save-result --result-dir $OUT --result-filename $1.json --label $1 2>&1 | summary $1
}
rewrite() { # label
  $TL bench serve --base-url http://127.0.0.1:$PORT --model smollm2 --dataset-name sharegpt \
    --dataset-path benchmarks/spec_decode_rewrite.json --num-prompts 4 --max-concurrency 1 --temperature 0 \
    --num-warmups 1 --disable-tqdm --save-result --result-dir $OUT --result-filename $1.json --label $1 2>&1 | summary $1
}
serve() { # label flags...
  local label=$1; shift
  $TL serve smollm2 --port $PORT "$@" > $OUT/$label-server.log 2>&1 &
  PID=$!
  wait_ready || { echo "$label: server not ready"; tail -5 $OUT/$label-server.log; }
}
spec_metrics() { # label: the counters since the server started (both workloads)
  curl -s localhost:$PORT/metrics | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" \
    | sed "s/^/$1: /"
}
stop() { kill $PID; wait $PID 2>/dev/null; sleep 2; }

plain() { serve plain; rewrite plain-rewrite; random_c1 plain-random-c1; stop; }
# each n-gram section: the settings, then the same two workloads
ngram_k4_n2() { # the settings of the s9 sitting
  serve ngram_k4_n2 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
  rewrite ngram_k4_n2-rewrite; spec_metrics ngram_k4_n2-rewrite; random_c1 ngram_k4_n2-random-c1; spec_metrics ngram_k4_n2-both
  stop
}
ngram_k4_n1() { # issue 23's setting: one-token suffixes too, the proposer votes among their continuations
  serve ngram_k4_n1 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
  rewrite ngram_k4_n1-rewrite; spec_metrics ngram_k4_n1-rewrite; random_c1 ngram_k4_n1-random-c1; spec_metrics ngram_k4_n1-both
  stop
}
# sections to run (default: all), e.g. bash benchmarks/s10_sitting.sh OUT plain ngram_k4_n1
shift || true
for section in ${@:-plain ngram_k4_n1 ngram_k4_n2}; do $section; done
