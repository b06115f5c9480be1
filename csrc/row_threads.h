// How the host-side row copies (the finish path's gather, the staging scatter) split over threads.
//
// A call of total_bytes over T rows runs fn(begin, end) on up to num_threads threads, each taking a
// contiguous range of about T / n rows and at least kMinBytesPerThread bytes (below that a thread costs
// more to start than it saves); the calling thread takes the first range, and the call returns when all
// ranges are done. A thread that cannot be started (std::system_error, std::bad_alloc) has its range
// run on the calling thread instead. fn must not throw (the callers check everything before copying)
// and must fence its own streamed stores (stream_copy.h) before it returns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace sglang_hs {

constexpr int64_t kMinBytesPerThread = 8 << 20;

template <class F>
void for_row_ranges(int64_t T, int64_t total_bytes, int64_t num_threads, const F& fn) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>({num_threads, total_bytes / kMinBytesPerThread, T}));
  if (n == 1) {
    fn(int64_t{0}, T);
    return;
  }
  std::vector<std::thread> helpers;
  helpers.reserve(n - 1);
  const int64_t per = (T + n - 1) / n;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t b = std::min(T, i * per), e = std::min(T, (i + 1) * per);
    try {
      helpers.emplace_back([&fn, b, e] { fn(b, e); });
    } catch (...) {  // no thread to be had: this range here; the threads already started are joined below
      fn(b, e);
    }
  }
  fn(int64_t{0}, std::min(T, per));
  for (auto& h : helpers) h.join();
}

}  // namespace sglang_hs
