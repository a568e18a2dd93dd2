#include "core/method_traits.hpp"

#include "core/error.hpp"

namespace akv {
namespace {

// {method, name, evicting, compactable, dense, cuda_compress}
const MethodTraits kMethods[] = {
    {AKV_METHOD_FULLKV,    "FullKV",    false, false, true,  true},
    {AKV_METHOD_ANCHORKV,  "AnchorKV",  false, true,  false, true},
    {AKV_METHOD_SNAPKV,    "SnapKV",    true,  true,  true,  true},
    {AKV_METHOD_PYRAMIDKV, "PyramidKV", true,  true,  true,  true},
    {AKV_METHOD_ADAKV,     "AdaKV",     true,  false, true,  true},
    {AKV_METHOD_ANDPRO,    "AnDPro",    true,  true,  true,  true},
    {AKV_METHOD_QUANTIZED, "Quantized", false, false, false, false},
};

}  // namespace

const MethodTraits *find_method_traits(akv_method m) {
  for (const MethodTraits &t : kMethods)
    if (t.method == m) return &t;
  return nullptr;
}

const MethodTraits &method_traits(akv_method m) {
  const MethodTraits *t = find_method_traits(m);
  if (!t) fail(AKV_ERR_UNSUPPORTED, "method ", static_cast<int>(m), " is not implemented in this version");
  return *t;
}

}  // namespace akv
