// AMX plumbing shared by the kernels that take it (AMX-INT8: cpu_w8a8.cpp, cpu_qlinear.cpp for
// many rows; AMX-BF16: the prompt-row panels of cpu_amx_bf16.h): whether this process may use the
// tile registers, the tile configuration, and the TOKENLOOM_CPU_AMX=0 switch. Only the avx512
// build has AMX paths (TOKENLOOM_AMX_BUILD); their functions carry target("amx-tile,amx-int8")
// (or amx-bf16) so that library still loads on an AVX-512 CPU without AMX (AMD EPYC), where
// amx_usable() and amx_bf16_usable() are false and they are never called.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_namespace.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define TOKENLOOM_AMX_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace TOKENLOOM_CPU_NAMESPACE {

// TOKENLOOM_CPU_AMX=0 (or false, no, off) keeps every kernel off AMX: the path an AVX-512 CPU
// without AMX takes, for tests and A/B measurements. Read at each call (a getenv, well under a
// microsecond), so a test can switch it between calls; the Python side reads the same variable
// (kernels/w8a8_matmul.py) for w8a8_linear's row threshold.
inline bool amx_switched_off() {
  const char* value = std::getenv("TOKENLOOM_CPU_AMX");
  if (value == nullptr) return false;
  while (*value == ' ') ++value;
  char word[8] = {};
  for (int i = 0; i < 7 && value[i] != '\0' && value[i] != ' '; ++i)
    word[i] = static_cast<char>(value[i] >= 'A' && value[i] <= 'Z' ? value[i] - 'A' + 'a' : value[i]);
  return std::strcmp(word, "0") == 0 || std::strcmp(word, "false") == 0 || std::strcmp(word, "no") == 0 ||
         std::strcmp(word, "off") == 0;
}

#if defined(TOKENLOOM_AMX_BUILD)

// whether Linux lets this process use the tile registers (asked once per process, only once a
// CPU with AMX-TILE asks: a thread's first tile instruction without the permission is a SIGILL)
inline bool amx_tile_permission() {
  static const bool granted = [] {
    constexpr int kXfeatureTileData = 18;      // XFEATURE_XTILEDATA
    constexpr int kArchReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return granted;
}

// whether this CPU has AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25) and the tile permission
inline bool amx_usable() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
    return amx_tile_permission();
  }();
  return usable;
}

// whether this CPU has AMX-TILE and AMX-BF16 (CPUID.(7,0):EDX bits 24, 22), AVX512-VBMI (ECX bit 1)
// and AVX512-BF16 (CPUID.(7,1):EAX bit 5: the panels of cpu_amx_bf16.h gather codes by vpermb and
// round by vcvtne2ps2bf16; every CPU with AMX-BF16 has both) and the tile permission
inline bool amx_bf16_usable() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1) || !((edx >> 22) & 1) || !((ecx >> 1) & 1)) return false;
    if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !((eax >> 5) & 1)) return false;
    return amx_tile_permission();
  }();
  return usable;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-7 configured as rows[t] rows of colsb[t] bytes, in the calling thread (tile state is
// per thread: configure at the start of each parallel region's body)
__attribute__((target("amx-tile"))) inline void amx_configure(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  AmxTileConfig config{};
  config.palette_id = 1;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = rows[tile];
    config.colsb[tile] = colsb[tile];
  }
  // (ldtilecfg is an asm statement that tells the compiler it reads 8 bytes of the config: make
  // all 64 bytes be stored first)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

#else

inline bool amx_usable() { return false; }
inline bool amx_bf16_usable() { return false; }

#endif

// whether a kernel may take its AMX path in this call: the CPU and kernel allow it, and
// TOKENLOOM_CPU_AMX does not switch it off
inline bool amx_enabled() { return amx_usable() && !amx_switched_off(); }

}  // namespace TOKENLOOM_CPU_NAMESPACE
