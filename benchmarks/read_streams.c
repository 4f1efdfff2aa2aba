// How fast this machine reads memory with hand-written loops, beside memory_bandwidth.py's torch
// sum: the rate a weight-streaming kernel can reach, and so the floor under a decode step. A 2 GiB
// buffer (far past the last-level cache) is split into one range per thread; each thread reads its
// range as S streams side by side (stream s: the s-th part of the range, 256 bytes of each in turn,
// xor-folded into registers), optionally prefetching D bytes ahead of each. Best of 6 passes.
// A core keeps more reads in flight with several streams than the hardware prefetcher keeps for
// one, so the rate with S = 2-8 is the one to name as the floor; S = 1 is what a kernel reading one
// stream a thread (and torch's sum) gets.
// Build and run (AVX-512; THREADS defaults to OpenMP's, the machine's cores):
//   gcc -O2 -mavx512f -fopenmp benchmarks/read_streams.c -o /tmp/read_streams
//   /tmp/read_streams              # every S in 1 2 4 8, D in 0 1024 4096, 1 thread and all
//   /tmp/read_streams S D THREADS  # one case
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double read_rate(const char* buffer, size_t bytes, int streams, int distance, int threads) {
  double best = 1e30;
  long sink = 0;
  for (int pass = 0; pass < 6; ++pass) {
    const double started = now();
#pragma omp parallel num_threads(threads) reduction(^ : sink)
    {
      const size_t range = bytes / omp_get_num_threads();
      const char* start = buffer + omp_get_thread_num() * range;
      const size_t part = range / streams / 256 * 256;
      __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      for (size_t offset = 0; offset < part; offset += 256)
        for (int s = 0; s < streams; ++s) {
          const char* at = start + s * part + offset;
          if (distance)
            for (int line = 0; line < 256; line += 64) _mm_prefetch(at + distance + line, _MM_HINT_T0);
          acc0 = _mm512_xor_si512(acc0, _mm512_load_si512(at));
          acc1 = _mm512_xor_si512(acc1, _mm512_load_si512(at + 64));
          acc2 = _mm512_xor_si512(acc2, _mm512_load_si512(at + 128));
          acc3 = _mm512_xor_si512(acc3, _mm512_load_si512(at + 192));
        }
      sink ^= _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(acc0, acc1), _mm512_xor_si512(acc2, acc3)));
    }
    const double elapsed = now() - started;
    if (elapsed < best) best = elapsed;
  }
  if (sink == 42) printf(" ");  // keeps the reads
  return bytes / best / 1e9;
}

int main(int argc, char** argv) {
  const size_t bytes = (size_t)2 << 30;
  char* buffer = aligned_alloc(2 << 20, bytes);
  memset(buffer, 1, bytes);
  const int cores = omp_get_max_threads();
  if (argc == 4) {
    const int streams = atoi(argv[1]), distance = atoi(argv[2]), threads = atoi(argv[3]);
    printf("%d stream(s), prefetch %d B, %d thread(s): %.1f GB/s\n", streams, distance, threads,
           read_rate(buffer, bytes, streams, distance, threads));
    return 0;
  }
  const int all_streams[] = {1, 2, 4, 8}, distances[] = {0, 1024, 4096};
  for (int threads = 1; threads <= cores; threads += cores > 1 ? cores - 1 : 1)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 3; ++j)
        printf("%d stream(s), prefetch %4d B, %d thread(s): %.1f GB/s\n", all_streams[i], distances[j], threads,
               read_rate(buffer, bytes, all_streams[i], distances[j], threads));
  return 0;
}
