// Status words and the thread-local last-error message.
#include "api/guard.hpp"

namespace akv {

static thread_local std::string g_last_error;

void set_last_error(const std::string &message) { g_last_error = message; }
const char *last_error() { return g_last_error.c_str(); }

}  // namespace akv

extern "C" {

AKV_API const char *akv_status_string(akv_status status) {
  switch (status) {
    case AKV_OK: return "AKV_OK: success";
    case AKV_ERR_INVALID_ARGUMENT: return "AKV_ERR_INVALID_ARGUMENT: invalid argument";
    case AKV_ERR_UNSUPPORTED: return "AKV_ERR_UNSUPPORTED: not supported by this build, backend or method";
    case AKV_ERR_BUDGET: return "AKV_ERR_BUDGET: retain_fraction too small for the anchors and metadata";
    case AKV_ERR_NON_FINITE: return "AKV_ERR_NON_FINITE: NaN or Inf in the input";
    case AKV_ERR_OUT_OF_MEMORY: return "AKV_ERR_OUT_OF_MEMORY: allocation failed";
    case AKV_ERR_CORRUPT_DATA: return "AKV_ERR_CORRUPT_DATA: serialized data truncated or corrupted";
    case AKV_ERR_VERSION: return "AKV_ERR_VERSION: serialized data from an unsupported format version";
    case AKV_ERR_BACKEND_UNAVAILABLE: return "AKV_ERR_BACKEND_UNAVAILABLE: backend not built or no device";
    case AKV_ERR_BACKEND: return "AKV_ERR_BACKEND: the device runtime reported an error";
    case AKV_ERR_MISMATCH: return "AKV_ERR_MISMATCH: handles or tensors that do not belong together";
    case AKV_ERR_CAPACITY: return "AKV_ERR_CAPACITY: buffer too small";
    case AKV_ERR_INTERNAL: return "AKV_ERR_INTERNAL: internal error";
  }
  return "AKV_ERR_UNKNOWN: unknown status value";
}

AKV_API const char *akv_last_error_message(void) { return akv::last_error(); }

}  // extern "C"
