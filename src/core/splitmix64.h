// splitmix64 (Steele, Lea, Flood 2014): the one mixing function behind the sampler's RNG stream
// and the synthetic weights. Defined here rather than taken from <random> so that a seed gives
// the same numbers on every standard library.
#pragma once
#include <cstdint>

namespace mb {

inline constexpr uint64_t kSplitmix64Gamma = 0x9E3779B97F4A7C15ull;

// The finaliser: a bijective mix of one 64-bit value.
inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The generator: advances `state` by the golden-ratio gamma and mixes it.
inline uint64_t splitmix64_next(uint64_t& state) { return splitmix64_mix(state += kSplitmix64Gamma); }

}  // namespace mb
