#!/usr/bin/env bash
# Runs a command as it runs on an x86 CPU with AVX2 + FMA and no AVX-512, on an AVX-512 host:
#
#   benchmarks/avx2_host.sh make test
#   benchmarks/avx2_host.sh .venv/bin/tokenloom serve smollm2
#
# What an AVX2-only CPU changes for tokenloom and its libraries, and how each is held to it here:
# - tokenloom's kernel levels, its bfloat16 choice and its kernel builds read /proc/cpuinfo: the
#   command sees a copy without the AVX-512, AMX and AVX-VNNI flags (bind-mounted over it in a
#   private mount namespace, so nothing outside the command sees it; needs root, as on these
#   machines);
# - torch's own kernels: ATEN_CPU_CAPABILITY=avx2; oneDNN (torch's packed and bfloat16 matmuls):
#   ONEDNN_MAX_CPU_ISA=AVX2; MKL: MKL_ENABLE_INSTRUCTIONS=AVX2; glibc's string functions:
#   GLIBC_TUNABLES without the AVX-512 hardware capabilities.
# What it cannot hold: code that runs CPUID itself and picks AVX-512 on its own (a
# -march=native build of another program), and the host's caches, clocks and memory, which stay
# the AVX-512 machine's. Figures taken under it are a stand-in for an AVX2-only machine, and say so.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
grep -qw avx2 /proc/cpuinfo || { echo "$0: this CPU has no AVX2" >&2; exit 2; }

masked=$(mktemp /tmp/cpuinfo-avx2.XXXXXX)
trap 'rm -f "$masked"' EXIT
sed -E '/^flags/ s/ (avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni[a-z_0-9]*|avx_ifma|avx_ne_convert)\b//g' \
  /proc/cpuinfo > "$masked"

export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,-AVX512BW,-AVX512CD,-AVX512DQ,-AVX512VL,-AVX512ER,-AVX512PF
unshare --mount --propagation private sh -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' \
  "$masked" "$@"
