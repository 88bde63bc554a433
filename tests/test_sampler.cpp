#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
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

// A nucleus larger than the first sorted prefix (64): 1000 equal logits, top_p 0.5 keeps the 500
// lowest ids (ties go to the lower id), and draws reach far into them.
TEST(Sampler, TopPNucleusBeyondTheFirstPrefix) {
  std::vector<float> l(1000, 0.5f);
  Sampler s({1.f, 0, 0.5f, 0.f, 9});
  int top = 0;
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = s.sample(l);
    ASSERT_LT(t, 500);
    top = std::max<int>(top, t);
  }
  EXPECT_GT(top, 400);
}

// Top-k then top-p over a large vocabulary, non-finite logits skipped: only the nucleus of the k.
TEST(Sampler, TopKThenTopPOnALargeVocabulary) {
  std::vector<float> l(262144, -5.f);
  for (int i = 0; i < 10; ++i) l[size_t(1000 * i + 7)] = 10.f - float(i);  // p ~ e^-i
  l[3] = std::numeric_limits<float>::quiet_NaN();
  Sampler s({1.f, 5, 0.9f, 0.f, 4});
  std::map<int, int> seen;
  for (int i = 0; i < 400; ++i) seen[s.sample(l)]++;
  // Among the 5: 0.636, 0.234, 0.086, ...; the first two hold 0.870 < 0.9, three 0.956.
  for (auto [t, n] : seen) EXPECT_TRUE(t == 7 || t == 1007 || t == 2007) << t;
  EXPECT_GT(seen[7], seen[1007]);
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
