// What an AMX tile instruction costs on this CPU, and what the AMX-BF16 prompt loop's tile loads
// add (docs/design.md, "the prompt path"): TSC cycles per tile instruction for
//   1. `tdpbf16ps` into four independent accumulators on zero, gaussian-bfloat16 and random-bit
//      tiles, and `tdpbssd` (AMX-INT8, twice the products) on random bytes;
//   2. the prompt kernel's inner loop (per step of 32 bfloat16 features: two B tiles of a panel,
//      two A tiles of 16 rows, four products into 2 x 2 accumulators) over rows of K features in a
//      block of R rows, the panel walked in runs of S steps over all row chunks (S = K / 32: the
//      kernel's order; smaller S keeps a run of the panel in L1); the accumulators loaded and
//      stored around each run.
// Linux only (asks the kernel for the tile data state). Build and run:
//   gcc -O2 -mamx-tile -mamx-int8 -mamx-bf16 benchmarks/amx_tile_rates.c -lm -o /tmp/amx_tile_rates
//   /tmp/amx_tile_rates
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

typedef struct {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static uint16_t a_tiles[2][512] __attribute__((aligned(64))), b_tiles[2][512] __attribute__((aligned(64)));

static float gaussian(void) {
  const double u = (rand() + 1.0) / (RAND_MAX + 2.0), v = (rand() + 1.0) / (RAND_MAX + 2.0);
  return (float)(sqrt(-2 * log(u)) * cos(6.283185307 * v));
}

static uint16_t bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  return (uint16_t)(bits >> 16);
}

static void instruction_rates(void) {
  const char* kinds[] = {"zero", "gaussian bf16", "random bits"};
  const long n = 10000000;
  for (int kind = 0; kind < 3; ++kind) {
    for (int t = 0; t < 2; ++t)
      for (int i = 0; i < 512; ++i) {
        a_tiles[t][i] = kind == 0 ? 0 : kind == 1 ? bf16(gaussian()) : (uint16_t)rand();
        b_tiles[t][i] = kind == 0 ? 0 : kind == 1 ? bf16(0.02f * gaussian()) : (uint16_t)rand();
      }
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a_tiles[0], 64); _tile_loadd(5, a_tiles[1], 64);
    _tile_loadd(6, b_tiles[0], 64); _tile_loadd(7, b_tiles[1], 64);
    uint64_t started = __rdtsc();
    for (long i = 0; i < n; ++i) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    printf("tdpbf16ps, %-13s tiles: %.1f TSC cycles an instruction\n", kinds[kind], (double)(__rdtsc() - started) / (4.0 * n));
  }
  uint64_t started = __rdtsc();
  for (long i = 0; i < n; ++i) {
    _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
  }
  printf("tdpbssd,   random bytes  tiles: %.1f TSC cycles an instruction\n", (double)(__rdtsc() - started) / (4.0 * n));
}

// rows x K bfloat16 features (row stride 2 K bytes) over a panel of K / 32 steps of two 1 KiB B tiles
static void prompt_loop(int K, int rows, int run_steps) {
  const int steps = K / 32;
  uint8_t* x = aligned_alloc(64, (size_t)rows * K * 2);
  uint8_t* panel = aligned_alloc(64, (size_t)steps * 2048);
  float* sums = aligned_alloc(64, (size_t)rows * 32 * 4);
  memset(x, 1, (size_t)rows * K * 2), memset(panel, 1, (size_t)steps * 2048), memset(sums, 0, (size_t)rows * 128);
  const long stride = 2L * K;
  long ops = 0;
  uint64_t started = 0;
  for (int pass = 0; pass < 2; ++pass) {  // the first pass warms the caches and the AMX unit
    if (pass == 1) started = __rdtsc(), ops = 0;
    for (long rep = 0; rep < (long)(2e8 / ((double)rows * K)) + 1; ++rep)
      for (int s0 = 0; s0 < steps; s0 += run_steps)
        for (int m = 0; m < rows; m += 32) {
          float* c = sums + m * 32;
          _tile_loadd(0, c, 128); _tile_loadd(1, c + 16, 128); _tile_loadd(2, c + 512, 128); _tile_loadd(3, c + 528, 128);
          const uint8_t* a = x + (size_t)m * stride;
          for (int s = s0; s < s0 + run_steps; ++s) {
            const uint8_t* b = panel + (size_t)s * 2048;
            _tile_loadd(6, b, 64); _tile_loadd(7, b + 1024, 64);
            _tile_loadd(4, a + s * 64, stride);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a + 16 * stride + s * 64, stride);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            ops += 4;
          }
          _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
        }
  }
  printf("prompt loop, K %4d, %3d rows (%4d KiB), runs of %2d steps: %.1f TSC cycles a tdpbf16ps\n", K, rows,
         rows * K * 2 / 1024, run_steps, (double)(__rdtsc() - started) / ops);
  free(x), free(panel), free(sums);
}

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    fprintf(stderr, "the kernel did not grant the AMX tile state\n");
    return 1;
  }
  TileConfig config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int i = 0; i < 8; ++i) config.rows[i] = 16, config.colsb[i] = 64;
  _tile_loadconfig(&config);
  instruction_rates();
  prompt_loop(256, 32, 8);      // rows and panel in L1
  prompt_loop(2048, 256, 64);   // the kernel's shape: a 1 MiB block of rows in L2, a 128 KiB panel
  prompt_loop(2048, 256, 8);    // the same, the panel in runs of 8 steps (16 KiB: L1)
  _tile_release();
  return 0;
}
