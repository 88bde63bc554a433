// The serving runtime: paged KV with prefix caching, the scheduler (continuous batching, chunked
// prefill, preemption), per-request sampling, and batch invariance end to end.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/backend.h"
#include "core/error.h"
#include "runtime/async_engine.h"
#include "runtime/engine_core.h"
#include "runtime/kv_pages.h"
#include "test_util.h"

namespace {

using mb::EngineCore;
using mb::GenerationOptions;

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text, finish;
  std::vector<std::vector<mb::GeneratedToken>> per_choice;
  mb::RequestUsage usage;
};

mb::EngineOptions options(const std::string& fixture, int max_seqs = 8, const std::string& device = "cpu") {
  mb::EngineOptions o;
  o.model_path = mbtest::fixture(fixture);
  o.device = device;
  o.max_seqs = max_seqs;
  o.max_context = 256;
  o.page_tokens = 4;
  return o;
}

// Runs every request on one core at once (added together, stepped until all are done).
std::vector<Outcome> run_together(EngineCore& core, const std::vector<std::vector<int32_t>>& prompts,
                                  const std::vector<GenerationOptions>& opts) {
  std::vector<std::shared_ptr<mb::RequestStream>> streams;
  for (size_t i = 0; i < prompts.size(); ++i) {
    core.validate(prompts[i], opts[i]);
    streams.push_back(std::make_shared<mb::RequestStream>("r" + std::to_string(i), opts[i].n));
    core.add(streams.back(), {prompts[i], opts[i]});
  }
  std::vector<Outcome> out(prompts.size());
  for (size_t i = 0; i < out.size(); ++i) out[i].per_choice.resize(size_t(opts[i].n));
  auto drain = [&] {
    for (size_t i = 0; i < streams.size(); ++i)
      while (auto e = streams[i]->next(std::chrono::milliseconds(0))) {
        for (const auto& g : e->tokens) {
          if (e->index == 0) out[i].tokens.push_back(g.token);
          out[i].per_choice[size_t(e->index)].push_back(g);
        }
        if (e->index == 0) out[i].text += e->text;
        if (!e->finish_reason.empty() && e->index == 0) out[i].finish = e->finish_reason;
      }
  };
  for (int guard = 0; core.has_work(); ++guard) {
    EXPECT_LT(guard, 100000) << "the engine does not finish";
    if (guard >= 100000) break;
    core.step();
    drain();
  }
  drain();
  for (size_t i = 0; i < streams.size(); ++i) {
    EXPECT_TRUE(streams[i]->done());
    out[i].usage = streams[i]->usage();
  }
  return out;
}

Outcome run_alone(const std::string& fixture, const std::vector<int32_t>& prompt, const GenerationOptions& o,
                  const std::string& device = "cpu") {
  mb::EngineOptions eo = options(fixture, 1, device);
  eo.prefix_cache = false;
  EngineCore core(eo);
  return run_together(core, {prompt}, {o})[0];
}

std::vector<int32_t> prompt_of(int len, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(int32_t(2 + (i * 37 + salt * 101) % 500));
  return p;
}

GenerationOptions sampled(uint64_t seed, int max_tokens = 12) {
  GenerationOptions o;
  o.max_tokens = max_tokens;
  o.temperature = 0.9f;
  o.top_k = 40;
  o.top_p = 0.95f;
  o.seed = seed;
  o.ignore_eos = true;
  return o;
}

GenerationOptions greedy(int max_tokens = 12) {
  GenerationOptions o;
  o.max_tokens = max_tokens;
  o.ignore_eos = true;
  return o;
}

class Serving : public ::testing::TestWithParam<const char*> {};

// A sampled request picks where the logits are (Model::forward_pick, Backend::sample_rows) unless
// it asks for logprobs, which brings every row to the host for Sampler::sample: the same seed gives
// the same tokens both ways, for every filter, alone and beside a greedy request.
void expect_sampled_picks_are_the_samplers(const std::string& fixture, const std::string& device) {
  const std::vector<int32_t> prompt = prompt_of(11, 3);
  for (int kind = 0; kind < 4; ++kind) {
    GenerationOptions o = sampled(40 + uint64_t(kind), 10);
    o.temperature = 4.f;  // the fixtures' distributions are peaked: flat enough that u matters
    o.top_k = kind == 1 ? 0 : kind == 3 ? 3 : 40;
    o.top_p = kind == 0 ? 1.f : 0.8f;
    o.min_p = kind == 2 ? 0.05f : 0.f;
    GenerationOptions with_logprobs = o;
    with_logprobs.logprobs = true;
    const Outcome picked = run_alone(fixture, prompt, o, device),
                  host = run_alone(fixture, prompt, with_logprobs, device);
    EXPECT_EQ(picked.tokens, host.tokens) << device << " kind " << kind;
    EXPECT_EQ(picked.tokens.size(), 10u);
    EngineCore core(options(fixture, 2, device));
    const auto both = run_together(core, {prompt, prompt_of(7, 4)}, {o, greedy(10)});
    EXPECT_EQ(both[0].tokens, host.tokens) << device << " kind " << kind << " beside a greedy request";
  }
}

TEST_P(Serving, SampledPicksWhereTheLogitsAreEqualTheSamplersOwn) {
  expect_sampled_picks_are_the_samplers(GetParam(), "cpu");
}

// The same on a GPU: the picks of k_sample_rows (kernels_sample.cu) against Sampler::sample on the
// same rows brought to the host.
TEST_P(Serving, SampledPicksOnCudaEqualTheSamplersOwn) {
  if (!mb::cuda_device_available()) GTEST_SKIP() << "no CUDA device visible (or a build without CUDA)";
  expect_sampled_picks_are_the_samplers(GetParam(), "cuda");
}

// N requests of mixed lengths in one batch (chunked prefill beside decode, small pages, sliding
// windows freeing pages) give each request the tokens it gets alone, greedy and seeded.
TEST_P(Serving, ConcurrentRequestsEqualEachAlone) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerationOptions> opts;
  const int lens[] = {3, 40, 17, 70, 9, 25};
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(prompt_of(lens[i], i));
    opts.push_back(i % 2 ? sampled(100 + uint64_t(i)) : greedy());
  }
  mb::EngineOptions eo = options(GetParam(), 4);  // 6 requests, 4 slots: some wait for others
  eo.step_tokens = 24;                            // prompts are cut into chunks that share steps
  EngineCore core(eo);
  const auto together = run_together(core, prompts, opts);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Outcome alone = run_alone(GetParam(), prompts[i], opts[i]);
    EXPECT_EQ(together[i].tokens, alone.tokens) << "request " << i;
    EXPECT_EQ(together[i].tokens.size(), 12u);
    EXPECT_EQ(together[i].finish, "length");
  }
  EXPECT_EQ(core.pages().pages_used(), 0) << "finished requests hold no pages";
}

// A request that shares a prefix with an earlier one starts from its cached pages and gets the
// same tokens as without the cache; a second chat turn prefills only what is new.
TEST_P(Serving, PrefixCacheReusesPagesAndChangesNothing) {
  EngineCore core(options(GetParam()));
  const std::vector<int32_t> system = prompt_of(50, 7);
  std::vector<int32_t> a = system, b = system;
  for (int i = 0; i < 5; ++i) a.push_back(int32_t(3 + i)), b.push_back(int32_t(300 + i));
  const Outcome first = run_together(core, {a}, {greedy()})[0];
  EXPECT_EQ(first.usage.cached_prompt_tokens, 0);
  const Outcome second = run_together(core, {b}, {greedy()})[0];
  EXPECT_EQ(second.usage.cached_prompt_tokens, 48) << "the shared 50 tokens, in whole pages of 4";
  EXPECT_EQ(second.tokens, run_alone(GetParam(), b, greedy()).tokens);
  // The next turn: the first request's prompt and reply, then a new user message.
  std::vector<int32_t> turn2 = a;
  turn2.insert(turn2.end(), first.tokens.begin(), first.tokens.end());
  for (int i = 0; i < 6; ++i) turn2.push_back(int32_t(400 + i));
  const Outcome third = run_together(core, {turn2}, {greedy()})[0];
  const int64_t reusable = (int64_t(a.size() + first.tokens.size()) - 1) / 4 * 4;
  EXPECT_EQ(third.usage.cached_prompt_tokens, reusable) << "only the new tokens (and a page's tail) are prefilled";
  EXPECT_EQ(third.tokens, run_alone(GetParam(), turn2, greedy()).tokens);
  const mb::EngineMetrics m = core.metrics();
  EXPECT_GT(m.prefix_hit_tokens, 0);
  EXPECT_EQ(m.pages_used, 0);
  EXPECT_GT(m.pages_cached, 0);
}

// With KV memory for about one sequence, running sequences are preempted and recomputed, and
// every request still gets exactly the tokens it gets alone.
TEST_P(Serving, PreemptionUnderMemoryPressureKeepsResults) {
  mb::EngineOptions eo = options(GetParam(), 4);
  eo.max_context = 96;
  EngineCore probe(eo);
  eo.kv_bytes = mb::KVPageManager::min_bytes(probe.config(), {4, 96, 512, 4, 0, true}) * 3 / 2;
  EngineCore core(eo);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerationOptions> opts;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(prompt_of(30 + 5 * i, 20 + i));
    opts.push_back(i % 2 ? sampled(7 + uint64_t(i), 30) : greedy(30));
  }
  const auto together = run_together(core, prompts, opts);
  EXPECT_GT(core.metrics().preempted_total, 0) << "the test should exercise preemption";
  for (size_t i = 0; i < prompts.size(); ++i) {
    mb::EngineOptions alone_opts = eo;
    alone_opts.max_seqs = 1;
    alone_opts.prefix_cache = false;
    EngineCore alone(alone_opts);
    EXPECT_EQ(together[i].tokens, run_together(alone, {prompts[i]}, {opts[i]})[0].tokens) << "request " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Serving, ::testing::Values("e2b_like", "gemma3_like"));

TEST(ServingSampling, NChoicesAreTheSeedsOneByOne) {
  EngineCore core(options("e2b_like"));
  GenerationOptions o = sampled(40);
  o.n = 3;
  const Outcome r = run_together(core, {prompt_of(20, 3)}, {o})[0];
  ASSERT_EQ(r.per_choice.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const Outcome one = run_alone("e2b_like", prompt_of(20, 3), sampled(40 + uint64_t(i)));
    std::vector<int32_t> ids;
    for (const auto& g : r.per_choice[size_t(i)]) ids.push_back(g.token);
    EXPECT_EQ(ids, one.tokens) << "choice " << i;
  }
  EXPECT_EQ(r.usage.completion_tokens, 36);
}

TEST(ServingSampling, LogitBiasPenaltiesStopIdsAndLogprobs) {
  EngineCore core(options("e2b_like"));
  const std::vector<int32_t> p = prompt_of(10, 1);
  GenerationOptions forced = greedy(5);
  forced.logit_bias = {{77, 100.f}};
  EXPECT_EQ(run_together(core, {p}, {forced})[0].tokens, std::vector<int32_t>(5, 77));
  const auto plain = run_together(core, {p}, {greedy(8)})[0].tokens;
  GenerationOptions rep = greedy(8);
  rep.repetition_penalty = 3.f;
  const auto penalised = run_together(core, {p}, {rep})[0].tokens;
  EXPECT_NE(plain, penalised);
  GenerationOptions stop = greedy(8);
  stop.stop_ids = {plain[2]};
  const Outcome s = run_together(core, {p}, {stop})[0];
  EXPECT_EQ(s.finish, "stop");
  EXPECT_EQ(s.tokens.back(), plain[2]);
  EXPECT_LE(s.tokens.size(), 3u);
  GenerationOptions lp = greedy(4);
  lp.logprobs = true;
  lp.top_logprobs = 3;
  const Outcome l = run_together(core, {p}, {lp})[0];
  for (const auto& g : l.per_choice[0]) {
    ASSERT_EQ(g.top.size(), 3u);
    EXPECT_EQ(g.top[0].token, g.token) << "greedy picks the most likely token";
    EXPECT_FLOAT_EQ(g.top[0].logprob, g.logprob);
    EXPECT_LE(g.logprob, 0.f);
    EXPECT_GE(g.top[0].logprob, g.top[1].logprob);
    EXPECT_TRUE(std::isfinite(g.logprob));
  }
}

TEST(ServingSampling, BadSettingsAreRefusedBeforeQueueing) {
  EngineCore core(options("e2b_like"));
  const std::vector<int32_t> p = {2, 3};
  auto refused = [&](GenerationOptions o, const std::string& what) {
    try {
      core.validate(p, o);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const mb::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  GenerationOptions o;
  o.temperature = -1;
  refused(o, "temperature");
  o = {};
  o.top_p = 0;
  refused(o, "top_p");
  o = {};
  o.n = 0;
  refused(o, "n must");
  o = {};
  o.logit_bias = {{100000, 1.f}};
  refused(o, "logit_bias");
  o = {};
  o.presence_penalty = 3;
  refused(o, "presence_penalty");
  o = {};
  o.top_logprobs = 21;
  refused(o, "top_logprobs");
  EXPECT_THROW(core.validate(std::vector<int32_t>(300, 2), {}), mb::Error) << "longer than the context";
  EXPECT_THROW(core.validate({2, 9999}, {}), mb::Error);
  EXPECT_FALSE(core.has_work());
}

// Through the engine thread: many clients at once, each stream gets its own tokens; a cancelled
// stream ends at once and frees its pages.
TEST(AsyncEngine, ConcurrentClientsAndCancellation) {
  mb::AsyncEngine engine(options("e2b_like", 4));
  std::vector<std::thread> clients;
  std::vector<std::vector<int32_t>> got(6);
  for (int i = 0; i < 6; ++i)
    clients.emplace_back([&, i] {
      auto s = engine.submit(prompt_of(10 + 7 * i, i), greedy(10));
      while (!s->done())
        if (auto e = s->next(std::chrono::milliseconds(100)))
          for (const auto& g : e->tokens) got[size_t(i)].push_back(g.token);
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[size_t(i)], run_alone("e2b_like", prompt_of(10 + 7 * i, i), greedy(10)).tokens);

  auto long_one = engine.submit(prompt_of(12, 9), greedy(200));
  while (long_one->usage().completion_tokens == 0 && !long_one->done())
    if (auto e = long_one->next(std::chrono::milliseconds(50)); e && !e->tokens.empty()) break;
  long_one->cancel();
  std::string finish;
  while (!long_one->done())
    if (auto e = long_one->next(std::chrono::milliseconds(100)); e && !e->finish_reason.empty()) finish = e->finish_reason;
  EXPECT_EQ(finish, "cancelled");
  for (int i = 0; i < 50 && engine.metrics().pages_used > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(engine.metrics().pages_used, 0);
  EXPECT_EQ(engine.metrics().running, 0);
}

TEST(AsyncEngine, FullQueueIsRefused) {
  mb::EngineOptions eo = options("e2b_like", 1);
  eo.max_queue = 2;
  mb::AsyncEngine engine(eo);
  std::vector<std::shared_ptr<mb::RequestStream>> keep;
  bool refused = false;
  for (int i = 0; i < 20 && !refused; ++i) {
    try {
      keep.push_back(engine.submit(prompt_of(8, i), greedy(100)));
    } catch (const mb::QueueFullError&) {
      refused = true;
    }
  }
  EXPECT_TRUE(refused);
  engine.shutdown(/*drain=*/false);
  for (auto& s : keep) {
    for (int i = 0; i < 100 && !s->done(); ++i) s->next(std::chrono::milliseconds(20));
    EXPECT_TRUE(s->done());
  }
}

}  // namespace
