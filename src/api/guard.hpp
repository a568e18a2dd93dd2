// Every exported function body runs inside guard(): exceptions become a status plus the
// thread-local message (faiss c_api's CATCH_AND_HANDLE). Nothing escapes the ABI.
#pragma once
#include <new>
#include <string>
#include "anchorkv/anchorkv.h"
#include "core/error.hpp"

namespace akv {

void set_last_error(const std::string &message);
const char *last_error();

template <typename F>
akv_status guard(const char *function, F &&body) noexcept {
  try {
    body();
    return AKV_OK;
  } catch (const Error &e) {
    set_last_error(std::string(function) + ": " + e.what());
    return e.status();
  } catch (const std::bad_alloc &) {
    set_last_error(std::string(function) + ": out of host memory");
    return AKV_ERR_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    set_last_error(std::string(function) + ": internal error: " + e.what());
    return AKV_ERR_INTERNAL;
  } catch (...) {
    set_last_error(std::string(function) + ": internal error (unknown exception)");
    return AKV_ERR_INTERNAL;
  }
}

}  // namespace akv
