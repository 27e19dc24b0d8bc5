// dearcomm._C_cuda: the NCCL backend and the fused copy kernels. A separate
// module, imported only when CUDA parameters appear, so that dearcomm imports
// with a CPU-only torch or without a driver.
//
// The backend crosses to dearcomm._C, which owns the engine, as a capsule
// (backend_capsule.h).
#include "backend_capsule.h"
#include "backends/nccl/comm_stream_pool.h"
#include "backends/nccl/fused_copy.h"
#include "backends/nccl/nccl_backend.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using namespace dearcomm;

namespace {

py::capsule make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix, int rank,
                              int world_size, int device, double timeout_seconds) {
  std::shared_ptr<CommBackend> backend;
  {
    py::gil_scoped_release no_gil;  // communicator creation waits for every rank
    backend = std::make_shared<NcclBackend>(store, key_prefix, rank, world_size,
                                            static_cast<c10::DeviceIndex>(device),
                                            std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
  }
  return backend_to_capsule(std::move(backend));
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "dearcomm NCCL backend and CUDA kernels";
  m.def("nccl_version", &nccl_version_string);
  m.def("nccl_backend", &make_nccl_backend, py::arg("store"), py::arg("key_prefix"), py::arg("rank"),
        py::arg("world_size"), py::arg("device"), py::arg("timeout_seconds"),
        "Creates the NCCL backend (one communicator, one stream) as a capsule for dearcomm._C.Engine.");
  m.def("events_created", [](const py::capsule& capsule) {
    const auto* backend = dynamic_cast<const NcclBackend*>(backend_from_capsule(capsule).get());
    TORCH_CHECK_TYPE(backend != nullptr, "dearcomm: events_created takes an NCCL backend");
    return backend->events_created();
  }, py::arg("backend"), "CUDA events the backend created so far (pooled; for tests).");
  m.def("comm_streams_created", &comm_streams_created,
        "Communication streams created so far in this process (pooled and reused; for tests).");
  m.def("fused_copy", &fused_copy, py::arg("sources"), py::arg("destinations"), py::arg("scale") = 1.0,
        py::call_guard<py::gil_scoped_release>(),
        "destinations[i] = cast(scale * sources[i]); contiguous fp32/fp16/bf16 pairs in one kernel launch.");
  m.def("pack_into", &pack_into, py::arg("sources"), py::arg("offsets"), py::arg("flat"), py::arg("scale") = 1.0,
        py::call_guard<py::gil_scoped_release>(), "The NCCL backend's pack: flat[offsets[i]:] = cast(scale * sources[i]).");
  m.def("unpack_from", &unpack_from, py::arg("flat"), py::arg("offsets"), py::arg("destinations"),
        py::call_guard<py::gil_scoped_release>(), "The NCCL backend's unpack: destinations[i] = flat[offsets[i]:].");
}
