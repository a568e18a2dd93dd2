#include "core/context.hpp"

akv_context::akv_context() = default;
akv_context::~akv_context() = default;
