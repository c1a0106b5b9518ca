// features.cuh: the compile-time features of a kernel instance, the bits of its FEATURES template
// argument (cuflash/_kernels.py, FEATURE_BITS, names the same bits). An instance carries code only
// for the features it has, so dense and causal attention pay nothing for the others.
#pragma once
#include "mask.cuh"

namespace cuflash {

template <int FEATURES>
struct Features {
  static constexpr bool LOCAL = (FEATURES & 1) != 0;  // the mask has a left bound (mask.cuh)
  typedef cuflash::Mask<LOCAL> Mask;
};

}  // namespace cuflash
