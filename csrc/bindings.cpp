// Python bindings of sglang_hs._C. Importing sglang_hs never loads this module; sglang_hs/_ext.py does,
// on first use, and says why when it cannot.
#include <torch/python.h>  // pybind11 and its at::Tensor casters, without the C++ frontend (torch/all.h)

namespace sglang_hs {
at::Tensor map_file(const std::string& dir, const std::string& name, int64_t nbytes, bool create,
                    int64_t owner_uid);
int64_t load_acquire(const at::Tensor& buf, int64_t offset);
void store_release(const at::Tensor& buf, int64_t offset, int64_t value);
int64_t fetch_add(const at::Tensor& buf, int64_t offset, int64_t delta);
void copy_rows_cpu(const at::Tensor& aux, const c10::optional<at::Tensor>& last, const at::Tensor& loc,
                   at::Tensor& store, int64_t num_threads);
void gather_rows_cpu(const at::Tensor& src, const c10::optional<at::Tensor>& idx, at::Tensor& out,
                     int64_t num_threads);
#ifdef SGLANG_HS_WITH_CUDA
void host_register(const at::Tensor& buf);
void host_unregister(const at::Tensor& buf);
int64_t device_pointer(const at::Tensor& buf);
#endif
}  // namespace sglang_hs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace sglang_hs;
  m.def("map_file", &map_file, "Map (or create, 0600, O_EXCL) a file under a folder, never via a symlink",
        py::arg("dir"), py::arg("name"), py::arg("nbytes"), py::arg("create"), py::arg("owner_uid") = -1);
  m.def("load_acquire", &load_acquire, py::arg("buf"), py::arg("offset"));
  m.def("store_release", &store_release, py::arg("buf"), py::arg("offset"), py::arg("value"));
  m.def("fetch_add", &fetch_add, py::arg("buf"), py::arg("offset"), py::arg("delta"));
  // Without the GIL: the staging strategy's scatter runs on its own thread beside the scheduler's.
  m.def("copy_rows_cpu", &copy_rows_cpu, "store[loc[t]] = aux[t] as K rows (+ last[t]); the CPU capture copy",
        py::arg("aux"), py::arg("last"), py::arg("loc"), py::arg("store"), py::arg("num_threads") = 1,
        py::call_guard<py::gil_scoped_release>());
  // Without the GIL: the finish worker's gather (store -> output ring) runs beside the scheduler's Python.
  m.def("gather_rows_cpu", &gather_rows_cpu, "out[t] = src[idx[t]] (idx None: out = src); streamed, threaded",
        py::arg("src"), py::arg("idx"), py::arg("out"), py::arg("num_threads") = 1,
        py::call_guard<py::gil_scoped_release>());
#ifdef SGLANG_HS_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("host_register", &host_register, py::arg("buf"));
  m.def("host_unregister", &host_unregister, py::arg("buf"));
  m.def("device_pointer", &device_pointer, py::arg("buf"));
#else
  m.attr("with_cuda") = false;
#endif
}
