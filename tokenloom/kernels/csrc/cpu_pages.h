// Page-size hints for the large outputs of a prompt's operators (a 2048-token step of a 1.7B
// model writes tens of MiB a layer into fresh mappings): each is asked to be backed by 2 MiB pages
// before its first write, so that it faults in 2 MiB at a time instead of 4 KiB (per-fault locks
// and accounting were ~40 % of a SiLU over [2048 x 16384]) and its stores do not miss the TLB
// (each pair of the AMX panel kernels writes 64 or 128 bytes of every row, rows a row of N outputs
// apart). Only a hint, on the whole 2 MiB pages inside the tensor's own bytes: where transparent
// huge pages are off, or off Linux, nothing changes.
#pragma once

#include <cstdint>

#include "cpu_namespace.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace TOKENLOOM_CPU_NAMESPACE {

constexpr int64_t kHugePageOutputBytes = int64_t{16} << 20;  // outputs from this size take the hint

inline void huge_output_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePageOutputBytes) return;
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace TOKENLOOM_CPU_NAMESPACE
