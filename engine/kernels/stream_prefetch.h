// Reading a weight once, in address order, from memory: how far ahead a kernel asks for its lines.
// A core of a server CPU keeps too few misses in flight for its hardware prefetcher alone to reach the
// memory's bandwidth, and software prefetches into L1 (T0) hold one of its few fill buffers each until
// the line arrives. So each step of a kernel's loop asks twice for the lines of the bytes it reads: far
// ahead into L2 (T1), whose queue holds many more misses, and nearer into L1, by when the line is in L2.
// Both distances were chosen in an A/B of int4_vnni.cpp's kernel over a 3B model's block weights
// (docs/benchmarks/scale.md); farther than this the lines arrive too early and are evicted. A loop that does
// little work per byte asks otherwise (bf16_rows.cpp's one-row product: into L2 alone), hence the arguments.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace layerstream {

constexpr int64_t PREFETCH_L1_BYTES = 1024;
constexpr int64_t PREFETCH_L2_BYTES = 4096;

// LINES 64-byte lines from p, the stretch a loop step reads, asked for ahead of it: L1_AHEAD bytes ahead into
// L1 and L2_AHEAD bytes ahead into L2 (0: not asked for into that level).
template <int LINES, int64_t L1_AHEAD = PREFETCH_L1_BYTES, int64_t L2_AHEAD = PREFETCH_L2_BYTES>
inline void prefetch_stream(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int i = 0; i < LINES; ++i) {
    if constexpr (L1_AHEAD > 0) _mm_prefetch(c + L1_AHEAD + 64 * i, _MM_HINT_T0);
    if constexpr (L2_AHEAD > 0) _mm_prefetch(c + L2_AHEAD + 64 * i, _MM_HINT_T1);
  }
}

}  // namespace layerstream
