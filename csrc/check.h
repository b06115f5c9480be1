// Argument checks whose messages are formatted without iostreams.
//
// TORCH_CHECK builds its message with std::ostringstream (c10::str), instantiated in this library. A
// compiler that links libstdc++ statically into the extension gives the library its own copy of the
// stream code; on the CUDA image of issue 49 (g++ 13 that links it so) the numeric insertion of that
// copy crashed (SIGSEGV in num_put), so every refusal meant to raise a RuntimeError (a slot outside the
// store, a full /dev/shm) killed the process instead. These checks format with snprintf and throw
// std::runtime_error, which pybind11 raises as RuntimeError; no stream is involved on any path.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdio>
#include <stdexcept>
#include <string>

namespace sglang_hs {

template <class... Args>
[[noreturn]] void fail(const char* fmt, Args... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string msg(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::snprintf(msg.data(), msg.size() + 1, fmt, args...);
  throw std::runtime_error(msg);
}

// "[2, 3, 4]": a tensor's sizes for a message
inline std::string dims(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

inline const char* dtype_name(c10::ScalarType t) { return c10::toString(t); }

}  // namespace sglang_hs

// HS_CHECK(cond, printf-style format, args...): integers as long long (%lld), strings as const char*.
#define HS_CHECK(cond, ...)                                   \
  do {                                                        \
    if (C10_UNLIKELY(!(cond))) ::sglang_hs::fail(__VA_ARGS__); \
  } while (0)
