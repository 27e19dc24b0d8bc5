// Errors of the core, in standard C++ only: the core links no ATen or c10, so
// it raises std exceptions (pybind11 turns std::runtime_error into
// RuntimeError, std::invalid_argument into ValueError, std::out_of_range into
// IndexError). Messages start with "dearcomm: " like every other error.
#pragma once

#include <sstream>
#include <string>

namespace dearcomm::core {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace dearcomm::core

// Throws `Exception(concat(...))` unless `cond`; the message is built only then.
#define DEARCOMM_CORE_CHECK(cond, Exception, ...)                \
  do {                                                           \
    if (!(cond)) {                                               \
      throw Exception(::dearcomm::core::concat(__VA_ARGS__));    \
    }                                                            \
  } while (false)
