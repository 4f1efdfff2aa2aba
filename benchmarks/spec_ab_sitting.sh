#!/bin/bash
# Issue 23 (speculation at c=1) as an interleaved A/B over HTTP: every server is started first,
# then each round runs the rewrite workload (benchmarks/spec_decode_rewrite.json, 4 prompts)
# and the random 256/128 workload (8 prompts) against each server in turn, so that a shared
# VM's drifting speed hits every configuration alike; the summary is each configuration's median
# TPOT over the rounds and its speed-up over the first (plain) one.
#   bash benchmarks/spec_ab_sitting.sh OUT [ROUNDS] [LABEL=SPECULATIVE_CONFIG_JSON ...]
# Default: 3 rounds of plain against the n-gram settings below. An idle server costs nothing
# while another is measured (the engine thread blocks, OpenMP threads sleep after their spin).
# TL (the tokenloom command) and BASE_PORT may be set in the environment; PEER_LABEL and PEER_CMD
# add a peer server measured in the same rounds (PEER_CMD serves the model as "smollm2" on the port
# written {port} in it), e.g. llama.cpp's llama-server built by ../shared/bench/peer.sh.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: spec_ab_sitting.sh OUT [ROUNDS] [LABEL=JSON ...]}
ROUNDS=${2:-3}
shift 2 2>/dev/null || shift $#
TL=${TL:-.venv/bin/tokenloom}
BASE_PORT=${BASE_PORT:-8100}
NGRAM_K4_N1='ngram_k4_n1={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
if [ $# -gt 0 ]; then CONFIGS=("plain=" "$@"); else CONFIGS=("plain=" "$NGRAM_K4_N1"); fi
mkdir -p "$OUT"
grep -o -w 'avx2\|avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | paste -sd ' ' > "$OUT/cpu_flags.txt"
echo "${TOKENLOOM_CPU_ISA:-native} ISA level; $(git rev-parse --short HEAD)" > "$OUT/sitting.txt"

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
for i in "${!CONFIGS[@]}"; do
  label=${CONFIGS[$i]%%=*} config=${CONFIGS[$i]#*=} port=$((BASE_PORT + i))
  flags=()
  [ -n "$config" ] && flags=(--speculative-config "$config")
  echo "$label: ${config:-no speculation}" >> "$OUT/sitting.txt"
  $TL serve smollm2 --port $port "${flags[@]}" > "$OUT/$label-server.log" 2>&1 &
  PIDS+=($!)
done
if [ -n "${PEER_LABEL:-}" ]; then
  port=$((BASE_PORT + ${#CONFIGS[@]}))
  echo "$PEER_LABEL (peer): ${PEER_CMD//\{port\}/$port}" >> "$OUT/sitting.txt"
  ${PEER_CMD//\{port\}/$port} > "$OUT/$PEER_LABEL-server.log" 2>&1 &
  PIDS+=($!)
  CONFIGS+=("$PEER_LABEL=peer")
fi
for i in "${!CONFIGS[@]}"; do
  port=$((BASE_PORT + i))
  for _ in $(seq 1 600); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
done

bench() { # port label workload flags...
  local port=$1 label=$2; shift 2
  $TL bench serve --base-url http://127.0.0.1:$port --model smollm2 --max-concurrency 1 --temperature 0 \
    --num-warmups 1 --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$label.json" --label "$label" \
    "$@" > "$OUT/$label.log" 2>&1 || echo "$label: bench failed (see $OUT/$label.log)"
}
for round in $(seq 1 "$ROUNDS"); do
  for i in "${!CONFIGS[@]}"; do
    label=${CONFIGS[$i]%%=*} port=$((BASE_PORT + i))
    bench $port "$label-rewrite-r$round" --dataset-name sharegpt --dataset-path benchmarks/spec_decode_rewrite.json \
      --num-prompts 4
    bench $port "$label-random-r$round" --dataset-name random --random-input-len 256 --random-output-len 128 \
      --ignore-eos --num-prompts 8
  done
done
for i in "${!CONFIGS[@]}"; do # the speculation counters of both workloads, all rounds
  label=${CONFIGS[$i]%%=*}
  curl -s localhost:$((BASE_PORT + i))/metrics | grep -E "^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total" \
    | sed "s/^/$label: /" >> "$OUT/spec_counters.txt"
done
labels=$(for config in "${CONFIGS[@]}"; do printf '%s ' "${config%%=*}"; done)
.venv/bin/python - "$OUT" "$ROUNDS" $labels << 'EOF' | tee "$OUT/summary.txt"
import json, statistics, sys
out, rounds, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for workload in ("rewrite", "random"):
    tpot = {}
    for label in labels:
        runs = []
        for r in range(1, rounds + 1):
            try:
                runs.append(json.load(open(f"{out}/{label}-{workload}-r{r}.json"))["mean_tpot_ms"])
            except (OSError, KeyError):
                pass
        tpot[label] = runs
    base = statistics.median(tpot[labels[0]]) if tpot[labels[0]] else None
    for label in labels:
        if not tpot[label]:
            print(f"{workload} {label}: no runs")
            continue
        median = statistics.median(tpot[label])
        rounds_text = " ".join(f"{t:.2f}" for t in tpot[label])
        ratio = f", {base / median:.2f}x plain" if base else ""
        print(f"{workload} {label}: median TPOT {median:.2f} ms{ratio} (rounds: {rounds_text})")
EOF
cat "$OUT/spec_counters.txt"
