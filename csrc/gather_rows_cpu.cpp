// The finish path's gather: a finished request's rows out of the store into the output ring.
//
//   gather_rows_cpu(src [S, ...], idx [T] int32/int64 | None, out [T, ...], num_threads)
//       out[t] = src[idx[t]]        (idx None: out = src, S = T; the ring's prepared-rows copy)
//
// Contract: CPU tensors, same dtype (a copy, never a cast), both contiguous and not overlapping, rows
// of equal size, every index in range (checked before anything is written). Runs of consecutive
// indices are copied as one block. Large gathers use streaming stores (stream_copy.h) and up to
// num_threads threads, each with at least kMinBytesPerThread (row_threads.h); the caller has released the GIL
// (bindings.cpp), so the finish worker's gather runs beside the scheduler's Python. Every byte is
// visible to other threads and processes when the call returns (each thread fences its streamed
// stores before it ends).
#include <ATen/core/Tensor.h>

#include <ATen/MemoryOverlap.h>
#include <c10/util/Optional.h>

#include "check.h"
#include "row_threads.h"
#include "stream_copy.h"

namespace sglang_hs {

namespace {

void copy_range(char* out, const char* src, const int64_t* idx, int64_t begin, int64_t end, int64_t row,
                bool stream) {
  int64_t t = begin;
  while (t < end) {
    int64_t run = 1;
    if (idx != nullptr) {
      while (t + run < end && idx[t + run] == idx[t] + run) ++run;
    } else {
      run = end - t;
    }
    const char* from = src + (idx != nullptr ? idx[t] : t) * row;
    char* to = out + t * row;
    copy_bytes(to, from, static_cast<size_t>(run * row), stream);
    t += run;
  }
  if (stream) stream_fence();
}

}  // namespace

void gather_rows_cpu(const at::Tensor& src, const c10::optional<at::Tensor>& idx, at::Tensor& out,
                     int64_t num_threads) {
  HS_CHECK(src.device().is_cpu() && out.device().is_cpu(), "gather_rows_cpu: src and out must be CPU tensors");
  HS_CHECK(src.dim() >= 1 && out.dim() == src.dim() && src.sizes().slice(1) == out.sizes().slice(1),
           "gather_rows_cpu: out %s does not hold rows of src %s", dims(out.sizes()).c_str(),
           dims(src.sizes()).c_str());
  HS_CHECK(src.is_contiguous() && out.is_contiguous(), "gather_rows_cpu: src and out must be contiguous");
  const auto overlap = at::get_overlap_status(out, src);
  HS_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
           "gather_rows_cpu: out overlaps src");
  HS_CHECK(src.scalar_type() == out.scalar_type(), "gather_rows_cpu: src is %s, out is %s",
           dtype_name(src.scalar_type()), dtype_name(out.scalar_type()));
  HS_CHECK(num_threads >= 1, "gather_rows_cpu: num_threads must be >= 1, got %lld", (long long)num_threads);
  const int64_t S = src.size(0), T = out.size(0);
  const bool has_idx = idx.has_value() && idx->defined();
  at::Tensor slots;
  const int64_t* s = nullptr;
  if (has_idx) {
    HS_CHECK(idx->device().is_cpu() && idx->dim() == 1 && idx->size(0) == T &&
                 (idx->scalar_type() == at::kInt || idx->scalar_type() == at::kLong),
             "gather_rows_cpu: idx must be a CPU [T=%lld] int32/int64 tensor, got %s %s", (long long)T,
             dims(idx->sizes()).c_str(), dtype_name(idx->scalar_type()));
    slots = idx->to(at::kLong).contiguous();
    s = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      HS_CHECK(s[t] >= 0 && s[t] < S, "gather_rows_cpu: index %lld of row %lld outside [0, %lld)", (long long)s[t],
               (long long)t, (long long)S);
    }
  } else {
    HS_CHECK(S == T, "gather_rows_cpu: without idx, out must have src's %lld rows, not %lld", (long long)S,
             (long long)T);
  }
  if (T == 0 || src.numel() == 0) return;
  const int64_t row = src.numel() / S * src.element_size();
  const int64_t total = T * row;
  const bool stream = total >= kStreamThresholdBytes;
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  for_row_ranges(T, total, num_threads, [&](int64_t b, int64_t e) { copy_range(to, from, s, b, e, row, stream); });
}

}  // namespace sglang_hs
