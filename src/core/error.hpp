// Errors inside the library are C++ exceptions carrying an akv_status; the C shims in api/
// turn them into a status plus the thread-local message. No exception crosses the ABI.
#pragma once
#include <stdexcept>
#include <string>
#include <sstream>
#include "anchorkv/anchorkv.h"

namespace akv {

class Error : public std::runtime_error {
 public:
  Error(akv_status status, const std::string &message)
      : std::runtime_error(message), status_(status) {}
  akv_status status() const noexcept { return status_; }

 private:
  akv_status status_;
};

namespace detail {
inline void append_all(std::ostringstream &) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream &os, const T &first, const Rest &...rest) {
  os << first;
  append_all(os, rest...);
}
}  // namespace detail

// fail(AKV_ERR_INVALID_ARGUMENT, "head_dim ", d, " is not a power of two")
template <typename... Parts>
[[noreturn]] void fail(akv_status status, const Parts &...parts) {
  std::ostringstream os;
  os.precision(6);
  detail::append_all(os, parts...);
  throw Error(status, os.str());
}

template <typename... Parts>
void require(bool condition, akv_status status, const Parts &...parts) {
  if (!condition) fail(status, parts...);
}

}  // namespace akv
