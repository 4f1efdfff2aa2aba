#!/bin/bash
# LoRA cost (issue 22) and n-gram speculation (issue 23), one server at a time, on a quiet
# machine: bash benchmarks/lora_and_spec_sitting.sh (results in benchmarks/results/2026-11-25-s8).
set -u
cd "$(dirname "$0")/.."
[ -d /tmp/adapters/a4 ] || .venv/bin/python benchmarks/make_lora_adapters.py /tmp/adapters 4
TL=.venv/bin/tokenloom
OUT=benchmarks/results/2026-11-25-s8
mkdir -p $OUT
wait_ready() { for i in $(seq 1 300); do curl -sf localhost:8000/health >/dev/null && return 0; sleep 1; done; return 1; }
run() { # label c n extra...
  local label=$1 c=$2 n=$3; shift 3
  $TL bench serve --base-url http://127.0.0.1:8000 --model smollm2 --dataset-name random --random-input-len 256 \
    --random-output-len 128 --ignore-eos --temperature 0 --max-concurrency $c --num-prompts $n --num-warmups 1 \
    --disable-tqdm --save-result --result-dir $OUT --result-filename $label.json --label $label "$@" 2>&1 \
    | grep -E "Output token throughput|Mean TPOT|Mean TTFT" | tr -s ' ' | paste -sd ' ' | sed "s/^/$label: /"
}
# 1. LoRA server: base, 1 adapter, 4 adapters at c=1 and c=32
$TL serve smollm2 --enable-lora --max-loras 4 --max-lora-rank 16 \
  --lora-modules a1=/tmp/adapters/a1 a2=/tmp/adapters/a2 a3=/tmp/adapters/a3 a4=/tmp/adapters/a4 > $OUT/lora_server.log 2>&1 &
PID=$!; wait_ready || { echo "lora server not ready"; tail $OUT/lora_server.log; }
for c in 1 32; do n=$(( c == 1 ? 8 : 64 ))
  run lora-base-c$c $c $n
  run lora-1adapter-c$c $c $n --lora-modules a1
  run lora-4adapters-c$c $c $n --lora-modules a1 a2 a3 a4
done
kill $PID; wait $PID 2>/dev/null
# 2. plain server: the same base runs
$TL serve smollm2 > $OUT/plain_server.log 2>&1 &
PID=$!; wait_ready
for c in 1 32; do n=$(( c == 1 ? 8 : 64 )); run plain-c$c $c $n; done
# speculation workloads against the plain server
$TL bench serve --base-url http://127.0.0.1:8000 --model smollm2 --dataset-name sharegpt \
  --dataset-path benchmarks/spec_decode_rewrite.json --num-prompts 4 --max-concurrency 1 --temperature 0 --num-warmups 1 \
  --disable-tqdm --save-result --result-dir $OUT --result-filename plain-rewrite.json --label plain-rewrite 2>&1 \
  | grep -E "Output token throughput|Mean TPOT|Mean TTFT" | tr -s ' ' | paste -sd ' ' | sed "s/^/plain-rewrite: /"
kill $PID; wait $PID 2>/dev/null
# 3. n-gram server
$TL serve smollm2 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' > $OUT/ngram_server.log 2>&1 &
PID=$!; wait_ready
$TL bench serve --base-url http://127.0.0.1:8000 --model smollm2 --dataset-name sharegpt \
  --dataset-path benchmarks/spec_decode_rewrite.json --num-prompts 4 --max-concurrency 1 --temperature 0 --num-warmups 1 \
  --disable-tqdm --save-result --result-dir $OUT --result-filename ngram-rewrite.json --label ngram-rewrite 2>&1 \
  | grep -E "Output token throughput|Mean TPOT|Mean TTFT" | tr -s ' ' | paste -sd ' ' | sed "s/^/ngram-rewrite: /"
run ngram-random-c1 1 8
curl -s localhost:8000/metrics | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" 
kill $PID; wait $PID 2>/dev/null
