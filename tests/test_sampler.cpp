#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "runtime/sampler.h"

using namespace mb;

TEST(Sampler, GreedyPicksFirstMaximum) {
  std::vector<float> l = {0.f, 3.f, 1.f, 3.f};
  Sampler s({});
  EXPECT_EQ(s.sample(l), 1);
}

TEST(Sampler, SeedReproducesAndDiffers) {
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(i % 7) * 0.3f;
  auto draw = [&](uint64_t seed) {
    Sampler s({1.f, 0, 1.f, 0.f, seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l));
    return out;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

TEST(Sampler, TopKRestrictsCandidates) {
  std::vector<float> l = {5.f, 4.f, 3.f, 2.f, 1.f};
  Sampler s({2.f, 2, 1.f, 0.f, 1});
  for (int i = 0; i < 200; ++i) EXPECT_LT(s.sample(l), 2);
}

TEST(Sampler, TopPKeepsSmallestNucleus) {
  // Probabilities ~ {0.64, 0.24, 0.09, 0.03}: top_p 0.8 keeps the first two.
  std::vector<float> l = {2.f, 1.f, 0.f, -1.2f};
  Sampler s({1.f, 0, 0.8f, 0.f, 3});
  std::map<int, int> seen;
  for (int i = 0; i < 500; ++i) seen[s.sample(l)]++;
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_EQ(seen.count(2) + seen.count(3), 0u);
}

TEST(Sampler, MinPDropsUnlikelyTokens) {
  std::vector<float> l = {3.f, 2.9f, 0.f};
  Sampler s({1.f, 0, 1.f, 0.2f, 5});
  for (int i = 0; i < 300; ++i) EXPECT_NE(s.sample(l), 2);
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler({-1.f}), Error);
  EXPECT_THROW(Sampler({1.f, 0, 0.f}), Error);
  EXPECT_THROW(Sampler({1.f, 0, 1.f, 2.f}), Error);
}
