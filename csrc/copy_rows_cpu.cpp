// The CPU path of the capture copy (the CUDA path is the Triton kernel in sglang_hs/ops/copy_rows.py).
//
//   copy_rows_cpu(aux [T, K*H], last [T, H] | None, loc [T] int32/int64, store [S, P, H], num_threads)
//       store[loc[t], k, :] = aux[t, k*H:(k+1)*H]   for k < K
//       store[loc[t], K, :] = last[t, :]            when last is given (P = K + 1; else P = K)
//
// Same contract as the Triton launcher: same dtype everywhere (a copy, never a cast), unit stride
// along H, a contiguous store, every slot in range (checked before anything is written). Rows are
// copied one copy per row part (streaming stores for a large step), on up to num_threads threads
// for a large step (row_threads.h): the staging scatter, which must keep up with the GPU's copy to
// host; the CPU engine's forward copy passes 1 (its forward already uses every core). The caller has
// released the GIL (bindings.cpp). Graph-style padding rows all aim at the padding slot, which no
// request reads; which of them lands there last is unspecified (they may be on different threads).
#include <ATen/core/Tensor.h>

#include <c10/util/Optional.h>

#include "check.h"
#include "row_threads.h"
#include "stream_copy.h"

namespace sglang_hs {

void copy_rows_cpu(const at::Tensor& aux, const c10::optional<at::Tensor>& last, const at::Tensor& loc,
                   at::Tensor& store, int64_t num_threads) {
  HS_CHECK(store.device().is_cpu() && aux.device().is_cpu() && loc.device().is_cpu(),
           "copy_rows_cpu: aux, loc and store must be CPU tensors");
  HS_CHECK(store.dim() == 3 && store.is_contiguous(), "copy_rows_cpu: store must be a contiguous [S, P, H]");
  const int64_t S = store.size(0), P = store.size(1), H = store.size(2);
  const bool has_last = last.has_value() && last->defined();
  const int64_t K = P - (has_last ? 1 : 0);
  const int64_t T = aux.size(0);
  HS_CHECK(K >= 1 && aux.dim() == 2 && aux.size(1) == K * H,
           "copy_rows_cpu: aux %s does not hold K=%lld layers of H=%lld for a store of %s", dims(aux.sizes()).c_str(),
           (long long)K, (long long)H, dims(store.sizes()).c_str());
  HS_CHECK(aux.stride(1) == 1, "copy_rows_cpu: aux rows must be contiguous");
  HS_CHECK(aux.scalar_type() == store.scalar_type(), "copy_rows_cpu: aux is %s, store is %s",
           dtype_name(aux.scalar_type()), dtype_name(store.scalar_type()));
  if (has_last) {
    HS_CHECK(last->device().is_cpu() && last->dim() == 2 && last->size(0) == T && last->size(1) == H &&
                 last->stride(1) == 1 && last->scalar_type() == store.scalar_type(),
             "copy_rows_cpu: last %s does not match [T=%lld, H=%lld] %s", dims(last->sizes()).c_str(), (long long)T,
             (long long)H, dtype_name(store.scalar_type()));
  }
  HS_CHECK(loc.dim() == 1 && loc.size(0) == T && (loc.scalar_type() == at::kInt || loc.scalar_type() == at::kLong),
           "copy_rows_cpu: loc must be [T=%lld] int32/int64", (long long)T);
  HS_CHECK(num_threads >= 1, "copy_rows_cpu: num_threads must be >= 1, got %lld", (long long)num_threads);
  if (T == 0) return;
  const at::Tensor slots = loc.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    HS_CHECK(s[t] >= 0 && s[t] < S, "copy_rows_cpu: slot %lld of row %lld outside [0, %lld)", (long long)s[t],
             (long long)t, (long long)S);
  }
  const int64_t esz = store.element_size();
  const int64_t part = H * esz;
  const char* a = static_cast<const char*>(aux.data_ptr());
  const char* l = has_last ? static_cast<const char*>(last->data_ptr()) : nullptr;
  char* dst = static_cast<char*>(store.data_ptr());
  const int64_t a_row = aux.stride(0) * esz, l_row = has_last ? last->stride(0) * esz : 0;
  // A large step's rows (a long prefill, the staging scatter) are read only when their request
  // finishes: streamed past the cache (stream_copy.h); a decode step's few rows are copied plainly.
  const bool stream = T * P * part >= kStreamThresholdBytes;
  for_row_ranges(T, T * P * part, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      char* row = dst + s[t] * P * part;
      copy_bytes(row, a + t * a_row, K * part, stream);  // the K aux parts are adjacent in aux and store
      if (l) copy_bytes(row + K * part, l + t * l_row, part, stream);
    }
    if (stream) stream_fence();  // this thread's streamed stores, before the call returns
  });
}

}  // namespace sglang_hs
