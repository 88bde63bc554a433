#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <span>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "cli/commands.h"
#include "core/error.h"
#include "models/checkpoint.h"
#include "markbase/markbase.h"
#include "models/model.h"
#include "runtime/kv_cache.h"
#include "runtime/sampler.h"
#include "test_util.h"

namespace {

TEST(KVCache, MemoryFollowsWhatTheModelNeeds) {
  auto ck = mb::open_checkpoint(mbtest::fixture("e2b_like"));
  const auto& c = ck->config;
  auto be = mb::make_cpu_backend();
  const int64_t ctx = 4096, step = 16;
  mb::KVCache kv(c, *be, {1, ctx, step});
  size_t expect = 0;
  int shared = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& L = c.layers[size_t(l)];
    if (L.kv_source != l) {
      ++shared;
      // A shared layer reads its source's store: same object, no memory of its own.
      EXPECT_EQ(&kv.store(0, l), &kv.store(0, L.kv_source));
      continue;
    }
    const int64_t rows = L.kind == mb::AttnKind::Sliding ? c.sliding_window - 1 + step : ctx;
    EXPECT_EQ(kv.store(0, l).capacity, rows);
    expect += size_t(2 * rows * L.n_kv_heads * L.head_dim * 4);
  }
  EXPECT_GT(shared, 0);
  EXPECT_EQ(kv.bytes(), expect);
}

// A slot's stores are views of one zeroed block: each 64-byte aligned, none overlapping another
// (of its slot or of another slot), each written without touching the others.
TEST(KVCache, StoresAreDisjointAlignedAndZeroed) {
  auto ck = mb::open_checkpoint(mbtest::fixture("e2b_like"));
  const auto& c = ck->config;
  auto be = mb::make_cpu_backend();
  mb::KVCache kv(c, *be, {3, 100, 16});
  std::vector<std::pair<const uint8_t*, const uint8_t*>> spans;
  for (int s = 0; s < 3; ++s)
    for (int l = 0; l < c.n_layers; ++l) {
      if (c.layers[size_t(l)].kv_source != l) continue;
      mb::KVStore& st = kv.store(s, l);
      for (mb::Tensor* t : {&st.k, &st.v}) {
        ASSERT_EQ(t->dim(0), st.capacity);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 64, 0u);
        for (int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(t->f32()[i], 0.f);
        spans.push_back({t->ptr<uint8_t>(), t->ptr<uint8_t>() + t->nbytes()});
        std::fill(t->f32(), t->f32() + t->numel(), float(spans.size()));
      }
    }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first);
  size_t i = 0;
  for (int s = 0; s < 3; ++s)
    for (int l = 0; l < c.n_layers; ++l) {
      if (c.layers[size_t(l)].kv_source != l) continue;
      mb::KVStore& st = kv.store(s, l);
      for (mb::Tensor* t : {&st.k, &st.v}) {
        ++i;
        EXPECT_EQ(t->f32()[0], float(i));
        EXPECT_EQ(t->f32()[t->numel() - 1], float(i));
      }
    }
}

TEST(Kernels, DotMatchesScalarTwinOnOddSizes) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int n : {0, 1, 7, 8, 9, 31, 32, 33, 100, 257}) {
    std::vector<float> a(size_t(n) + 1), b(size_t(n) + 1);
    for (auto& v : a) v = nd(rng);
    for (auto& v : b) v = nd(rng);
    EXPECT_NEAR(mb::cpu::dot_f32(a.data(), b.data(), n), mb::cpu::dot_f32_ref(a.data(), b.data(), n),
                1e-4 * std::sqrt(double(n) + 1));
  }
}

TEST(Kernels, Bf16AndF16ConversionsRoundTrip) {
  std::vector<float> src = {0.f, 1.f, -2.5f, 3.1415926f, 1e-3f, 65504.f};
  std::vector<uint16_t> bf(src.size()), hf(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    bf[i] = mb::f32_to_bf16(src[i]);
    hf[i] = mb::f32_to_f16(src[i]);
  }
  std::vector<float> back(src.size());
  mb::cpu::to_f32(mb::DType::BF16, bf.data(), back.data(), int64_t(src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 128);
  mb::cpu::to_f32(mb::DType::F16, hf.data(), back.data(), int64_t(src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 1024 + 1e-6);
  EXPECT_EQ(mb::round_to_bf16(std::sqrt(1536.f)), 39.25f);  // E2B's effective embedding scale
  EXPECT_EQ(mb::round_to_bf16(std::sqrt(2560.f)), 50.5f);   // E4B's
}

TEST(Kernels, AttentionRespectsWindowAndRing) {
  // One head, head_dim 2, window 3, ring of 4 rows: queries see exactly their last 3 keys.
  auto be = mb::make_cpu_backend();
  mb::KVStore kv;
  kv.capacity = 4;
  kv.ring = true;
  kv.k = be->alloc(mb::DType::F32, {4, 1, 2});
  kv.v = be->alloc(mb::DType::F32, {4, 1, 2});
  mb::AttentionParams ap;
  ap.window = 3;
  for (int32_t p = 0; p < 10; ++p) {
    auto k = be->alloc(mb::DType::F32, {1, 1, 2}), v = be->alloc(mb::DType::F32, {1, 1, 2});
    v.f32()[0] = float(p);  // value = position, keys zero: output = mean of visible positions
    be->kv_write(kv, k, v, &p);
    auto q = be->alloc(mb::DType::F32, {1, 1, 2}), o = be->alloc(mb::DType::F32, {1, 1, 2});
    be->attention(q, kv, &p, ap, o);
    const int lo = std::max(0, p - 2);
    EXPECT_NEAR(o.f32()[0], (lo + p) / 2.0, 1e-5) << "position " << p;
  }
}

TEST(Engine, SampledGenerationIsReproducibleBySeed) {
  markbase::EngineOptions o;
  o.model_path = mbtest::fixture("e2b_like");
  auto engine = markbase::Engine::open(o);
  auto run = [&](uint64_t seed) {
    markbase::Request r;
    r.prompt_tokens = {2, 10, 20, 30};
    r.max_new_tokens = 12;
    r.stop_at_eos = false;
    r.sampling = {1.0f, 40, 0.95f, 0.f, seed};
    return engine->generate(r).tokens;
  };
  EXPECT_EQ(run(11), run(11));
  EXPECT_NE(run(11), run(12));
}

// transformers' greedy generate() on this prompt ends on a Gemma 4 stop token
// (tools/reference/make_stop_case.py); the engine stops there too, with the stop token last and
// out of the text.
TEST(Engine, StopsAtAStopToken) {
  const auto ref = mbtest::read_json(mbtest::fixture("e2b_like") + "/stop_case.json");
  const auto greedy = ref["greedy"].get<std::vector<int32_t>>();
  markbase::EngineOptions o;
  o.model_path = mbtest::fixture("e2b_like");
  auto engine = markbase::Engine::open(o);
  markbase::Request r;
  r.prompt_tokens = ref["prompt"].get<std::vector<int32_t>>();
  r.max_new_tokens = int(greedy.size()) + 8;
  auto res = engine->generate(r);
  EXPECT_EQ(res.tokens, greedy);
  EXPECT_EQ(res.finish_reason, "stop");
  EXPECT_EQ(res.text, engine->detokenize(std::vector<int32_t>(greedy.begin(), greedy.end() - 1)));
  // Without stopping, the same tokens come first and generation goes on to the limit.
  r.stop_at_eos = false;
  res = engine->generate(r);
  ASSERT_EQ(res.tokens.size(), greedy.size() + 8);
  EXPECT_TRUE(std::equal(greedy.begin(), greedy.end(), res.tokens.begin()));
  EXPECT_EQ(res.finish_reason, "length");
}

TEST(Engine, OnTokenReturningFalseCancels) {
  markbase::EngineOptions o;
  o.model_path = mbtest::fixture("dense_kv");
  auto engine = markbase::Engine::open(o);
  markbase::Request r;
  r.prompt_tokens = {2, 5, 6};
  r.max_new_tokens = 8;
  int seen = 0;
  r.on_token = [&](int32_t, std::string_view) { return ++seen < 3; };
  auto res = engine->generate(r);
  EXPECT_EQ(res.tokens.size(), 3u);
  EXPECT_EQ(seen, 3);
  EXPECT_EQ(res.finish_reason, "cancelled");
}

TEST(Cli, GenerateAndLogitsMatchReference) {
  auto ref = mbtest::read_json(mbtest::fixture("e2b_like") + "/reference.json");
  auto& p = ref["prompts"][1];
  std::string toks;
  for (auto& t : p["tokens"]) toks += (toks.empty() ? "" : ",") + std::to_string(t.get<int>());
  std::string greedy;
  for (auto& t : p["greedy"]) greedy += (greedy.empty() ? "" : ",") + std::to_string(t.get<int>());
  auto r = mbtest::run_cli("generate -m " + mbtest::fixture("e2b_like") + " --tokens " + toks + " -n " +
                           std::to_string(p["greedy"].size()) + " --print-ids --ignore-eos --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::string last = r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1);
  EXPECT_EQ(last, greedy + "\n");

  std::string out = mbtest::temp_dir("cli") + "/logits.bin";
  r = mbtest::run_cli("logits -m " + mbtest::fixture("e2b_like") + " --tokens " + toks + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto ours = mbtest::read_f32(out);
  auto theirs = mbtest::read_f32(mbtest::fixture("e2b_like") + "/" + p["logits_file"].get<std::string>());
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) ASSERT_NEAR(ours[i], theirs[i], 1e-4);

  r = mbtest::run_cli("info -m " + mbtest::fixture("e2b_like"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("KV from layer"), std::string::npos) << r.out;
}

TEST(Cli, TokenListParsing) {
  EXPECT_EQ(mb::cli::parse_token_list("2,17, 44"), (std::vector<int32_t>{2, 17, 44}));
  EXPECT_THROW(mb::cli::parse_token_list(""), mb::Error);
  EXPECT_THROW(mb::cli::parse_token_list("1,,2"), mb::Error);
  EXPECT_THROW(mb::cli::parse_token_list("1;2"), mb::Error);
  EXPECT_THROW(mb::cli::parse_token_list("99999999999"), mb::Error);
}

}  // namespace

namespace {

// Greedy picks taken where the logits are (Backend::argmax_rows; on a GPU they never reach the
// host): each row's first maximum, as the sampler's argmax, and -1 for a row with a NaN or an
// infinity, which the engine turns into an error as it does for non-finite logits.
TEST(GreedyPick, ArgmaxRowsIsTheFirstMaximumOrMinusOne) {
  auto be = mb::make_cpu_backend();
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {
      {1.f, 3.f, 2.f, 3.f, -1.f},  // tie: the first
      {-5.f, -4.f, -4.f, -9.f, -4.5f},
      {0.f, 0.f, 0.f, 0.f, 0.f},
      {1.f, nan, 2.f, 0.f, 0.f},
      {1.f, 2.f, inf, 0.f, 0.f},
      {-inf, 2.f, 1.f, 0.f, 0.f},
      {0.f, 0.f, 0.f, 0.f, 7.f}};
  const std::vector<int32_t> want = {1, 1, 0, -1, -1, -1, 4};
  std::vector<float> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  mb::Tensor x = be->alloc(mb::DType::F32, {int64_t(rows.size()), 5});
  be->upload(flat.data(), x);
  mb::Tensor ids = be->alloc(mb::DType::I32, {int64_t(rows.size())});
  be->argmax_rows(x, ids);
  std::vector<int32_t> got(rows.size());
  be->to_host(ids, got.data());
  EXPECT_EQ(got, want);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (want[i] < 0) continue;
    EXPECT_EQ(mb::argmax(rows[i]), want[i]) << "row " << i;
  }
}

// forward_pick gives the argmax of forward's rows without picks, and pick_token's token of them
// with picks (sampled: temperature, top-k, top-p, min-p), prompt and decode, one sequence and several.
TEST(GreedyPick, ForwardPickIsThePickOfForwardsRows) {
  std::shared_ptr<const mb::Checkpoint> ck = mb::open_checkpoint(mbtest::fixture("e2b_like"));
  auto be = mb::make_cpu_backend();
  auto model = mb::load_model(ck, *be, {});
  const int64_t V = ck->config.vocab_size;
  mb::KVCache kv_a(ck->config, *be, {3, 64, 16}), kv_b(ck->config, *be, {3, 64, 16});
  auto prompt = [](int s) {
    mb::Batch b;
    for (int32_t p = 0; p < 9; ++p) {
      b.tokens.push_back(int32_t(2 + (p * 37 + s * 11) % 200));
      b.positions.push_back(p);
    }
    b.seqs.push_back({s, 0, 9});
    b.logit_rows = {4, 8};
    return b;
  };
  std::vector<mb::Batch> steps = {prompt(0), prompt(1), prompt(2)};
  mb::Batch dec;
  for (int s = 0; s < 3; ++s) {
    dec.tokens.push_back(int32_t(5 + s));
    dec.positions.push_back(9);
    dec.seqs.push_back({s, s, 1});
    dec.logit_rows.push_back(s);
  }
  steps.push_back(dec);
  for (size_t i = 0; i < steps.size(); ++i) {
    std::vector<float> logits;
    std::vector<int32_t> ids;
    model->forward(steps[i], kv_a, logits);
    model->forward_pick(steps[i], kv_b, {}, ids);
    ASSERT_EQ(ids.size(), steps[i].logit_rows.size());
    for (size_t r = 0; r < ids.size(); ++r)
      EXPECT_EQ(ids[r], mb::argmax(std::span<const float>(logits.data() + r * size_t(V), size_t(V))))
          << "step " << i << " row " << r;
  }
  // The same steps again (the KV is the same: positions rewritten with the same values), sampled.
  for (size_t i = 0; i < steps.size(); ++i) {
    std::vector<float> logits;
    std::vector<int32_t> ids;
    std::vector<mb::TokenPick> picks;
    for (size_t r = 0; r < steps[i].logit_rows.size(); ++r)
      picks.push_back({1.5f, int32_t(r % 2 ? 5 : 0), r % 3 ? 0.9f : 1.f, r == 1 ? 0.05f : 0.f, std::fmod(0.1 + 0.37 * double(r + i), 1.0)});
    model->forward(steps[i], kv_a, logits);
    model->forward_pick(steps[i], kv_b, picks, ids);
    ASSERT_EQ(ids.size(), steps[i].logit_rows.size());
    std::vector<mb::PickCandidate> scratch;
    for (size_t r = 0; r < ids.size(); ++r)
      EXPECT_EQ(ids[r], mb::pick_token(std::span<const float>(logits.data() + r * size_t(V), size_t(V)), picks[r], scratch))
          << "step " << i << " row " << r;
  }
}

}  // namespace
