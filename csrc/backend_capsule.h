// A CommBackend crossing between dearcomm's Python modules: a PyCapsule that
// owns a std::shared_ptr<CommBackend>. dearcomm._C_cuda makes NCCL backends,
// dearcomm._C makes c10d ones and runs engines over either; both compile this
// header against the same libtorch and pybind11.
#pragma once

#include "engine/comm_backend.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

namespace dearcomm {

constexpr const char* kBackendCapsuleName = "dearcomm.CommBackend";

inline pybind11::capsule backend_to_capsule(std::shared_ptr<CommBackend> backend) {
  auto* holder = new std::shared_ptr<CommBackend>(std::move(backend));
  return pybind11::capsule(holder, kBackendCapsuleName, [](PyObject* capsule) {
    delete static_cast<std::shared_ptr<CommBackend>*>(PyCapsule_GetPointer(capsule, kBackendCapsuleName));
  });
}

inline std::shared_ptr<CommBackend> backend_from_capsule(const pybind11::capsule& capsule) {
  TORCH_CHECK_TYPE(capsule.name() != nullptr && std::string(capsule.name()) == kBackendCapsuleName,
      "dearcomm: expected a backend capsule (dearcomm._C.process_group_backend or dearcomm._C_cuda.nccl_backend)");
  return *capsule.get_pointer<std::shared_ptr<CommBackend>>();
}

}  // namespace dearcomm
