// Bulk copies of rows that nobody reads soon (the store, the output ring): non-temporal stores.
//
// A row of a DeepSeek-V3 capture is 57 KB, a finishing step's rows are hundreds of MB: far beyond any
// cache, so ordinary stores first read every destination line for ownership and then evict it again.
// Streaming (non-temporal) stores skip that read: measured on this project's CPU machine, a gather of
// 57 KB rows runs at ~0.9 of one large glibc memcpy with them and ~0.65 without (glibc switches to
// non-temporal stores only for a single copy larger than about 3/4 of the last-level cache, never for
// one row). SSE2 stores are as fast as AVX-512 ones here (memory-bound), and every x86-64 has them.
// Other architectures copy with memcpy.
//
// Streamed stores are weakly ordered: stream_fence() must run on the copying thread after its last
// stream_copy and before anything publishes the bytes (a release store, or the thread's exit before
// a join).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define SGLANG_HS_STREAM_STORES 1
#endif

namespace sglang_hs {

// Copies of at least this many bytes in total are streamed (see the note above); below it the
// destination may still be read from cache (a short record read at once by the reader).
constexpr int64_t kStreamThresholdBytes = 2 << 20;

inline void stream_copy(char* dst, const char* src, size_t n) {
#ifdef SGLANG_HS_STREAM_STORES
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (n < head + 64) {
    std::memcpy(dst, src, n);
    return;
  }
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// A copy of n bytes, streamed or plain (memcpy): the callers decide once per call by its total size.
inline void copy_bytes(char* dst, const char* src, size_t n, bool stream) {
  if (stream) {
    stream_copy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

inline void stream_fence() {
#ifdef SGLANG_HS_STREAM_STORES
  _mm_sfence();
#endif
}

}  // namespace sglang_hs
