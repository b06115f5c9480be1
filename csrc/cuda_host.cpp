// Page-locking of a shared-memory mapping for the GPU (built only when a CUDA toolkit is present and
// SGLANG_HS_SKIP_CUDA_BUILD is unset). Plain C++ against the CUDA runtime: no nvcc needed.
//
//   host_register(buf)    cudaHostRegister(buf, Portable | Mapped): the copy kernel can then write the
//                         mapping directly (zero-copy), and cudaMemcpyAsync into it runs at full speed.
//   host_unregister(buf)  the reverse; call before the mapping is unmapped.
//   device_pointer(buf)   the device address of a registered mapping (cudaHostGetDevicePointer).
#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include "check.h"

namespace sglang_hs {
namespace {
void check_host(const at::Tensor& buf, const char* fn) {
  HS_CHECK(buf.device().is_cpu() && buf.is_contiguous(), "sglang_hs.%s: expects a contiguous host tensor", fn);
}
void check_cuda(cudaError_t err, const char* fn) {
  HS_CHECK(err == cudaSuccess, "sglang_hs.%s: %s (%d): %s", fn, cudaGetErrorName(err), static_cast<int>(err),
           cudaGetErrorString(err));
}
}  // namespace

void host_register(const at::Tensor& buf) {
  check_host(buf, "host_register");
  check_cuda(cudaHostRegister(buf.data_ptr(), buf.nbytes(), cudaHostRegisterPortable | cudaHostRegisterMapped),
             "host_register");
}

void host_unregister(const at::Tensor& buf) {
  check_host(buf, "host_unregister");
  check_cuda(cudaHostUnregister(buf.data_ptr()), "host_unregister");
}

int64_t device_pointer(const at::Tensor& buf) {
  check_host(buf, "device_pointer");
  void* dev = nullptr;
  check_cuda(cudaHostGetDevicePointer(&dev, buf.data_ptr(), 0), "device_pointer");
  return reinterpret_cast<int64_t>(dev);
}
}  // namespace sglang_hs
