#pragma once
// The text of a caught exception, to quote inside dearcomm's own error: a
// c10::Error's what() carries its C++ backtrace (a dozen frames), which
// quoted in another error would bury the message Python shows.
#include <c10/util/Exception.h>

#include <exception>

namespace dearcomm {

inline const char* error_text(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace dearcomm
