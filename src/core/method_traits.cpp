#include "core/method_traits.hpp"

#include "core/error.hpp"

namespace akv {
namespace {

constexpr Storage kA = Storage::kAnchor, kD = Storage::kDense, kQ = Storage::kQuantized;
// {method, storage, name, evicting, compactable, cuda_compress}
const MethodTraits kMethods[] = {
    {AKV_METHOD_FULLKV,    kD, "FullKV",    false, false, true},
    {AKV_METHOD_ANCHORKV,  kA, "AnchorKV",  false, true,  true},
    {AKV_METHOD_SNAPKV,    kD, "SnapKV",    true,  true,  true},
    {AKV_METHOD_PYRAMIDKV, kD, "PyramidKV", true,  true,  true},
    {AKV_METHOD_ADAKV,     kD, "AdaKV",     true,  false, true},
    {AKV_METHOD_ANDPRO,    kD, "AnDPro",    true,  true,  true},
    {AKV_METHOD_QUANTIZED, kQ, "Quantized", false, false, false},
    {AKV_METHOD_TOVA,      kD, "TOVA",      true,  false, true},
    {AKV_METHOD_KNORM,     kD, "Knorm",     true,  false, true},
    {AKV_METHOD_STREAMINGLLM, kD, "StreamingLLM", true, false, true},
};

}  // namespace

const MethodTraits *find_method_traits(int32_t m) {
  for (const MethodTraits &t : kMethods)
    if (static_cast<int32_t>(t.method) == m) return &t;
  return nullptr;
}

const MethodTraits &method_traits(akv_method m) {
  const MethodTraits *t = find_method_traits(m);
  if (!t) fail(AKV_ERR_UNSUPPORTED, "method ", static_cast<int>(m), " is not implemented in this version");
  return *t;
}

}  // namespace akv
