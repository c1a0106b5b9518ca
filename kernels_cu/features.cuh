// features.cuh: the compile-time features of a kernel instance, the bits of its FEATURES template
// argument (cuflash/_kernels.py, FEATURE_BITS, names the same bits). An instance carries code only
// for the features it has, so dense and causal attention pay nothing for the others.
#pragma once
#include "mask.cuh"
#include "score_mod.cuh"

namespace cuflash {

template <int FEATURES>
struct Features {
  static constexpr bool LOCAL = (FEATURES & 1) != 0;    // the mask has a left bound (mask.cuh)
  static constexpr bool SOFTCAP = (FEATURES & 2) != 0;  // S = c tanh(S / c) (score_mod.cuh)
  static constexpr bool ALIBI = (FEATURES & 4) != 0;    // S -= slope |i + nk - nq - j|
  static constexpr bool PACKED = (FEATURES & 8) != 0;   // packed sequences (params.cuh, Seq)
  typedef cuflash::Mask<LOCAL> Mask;
  // Blocks per multiprocessor that the mma.sync kernels ask ptxas for (__launch_bounds__'s second
  // argument). 0 leaves it to ptxas, which aims at 3 blocks of 128 threads (168 registers) and
  // spilled 4-36 bytes in some instances with features to get there: those ask for 2.
  static constexpr int MMA_MIN_BLOCKS = FEATURES ? 2 : 0;
  // The score modifiers for scores of type T; PRECISE: the library's tanh (the exact kernels).
  template <typename T = float, bool PRECISE = false>
  using ScoreMod = cuflash::ScoreMod<SOFTCAP, ALIBI, T, PRECISE>;
};

}  // namespace cuflash
