// Activation memory (ScratchPool, Backend::scratch) and the op profiler of `markbase bench
// --profile`: blocks are reused and aligned, poisoned blocks do not change a forward pass (so no
// op reads output memory before writing it), and profiling changes no number.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>

#include "backends/backend.h"
#include "backends/profiling_backend.h"
#include "core/scratch_pool.h"
#include "models/model.h"
#include "models/gemma4/synthetic.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

namespace {

// Restores the poisoning switch a test changed.
struct PoisonGuard {
  bool was = mb::ScratchPool::poison();
  ~PoisonGuard() { mb::ScratchPool::set_poison(was); }
};

TEST(ScratchPool, ReusesFreedBlocksOfTheSameSize) {
  mb::ScratchPool pool;
  void* first = nullptr;
  {
    auto a = pool.get(100000);
    first = a.get();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    EXPECT_EQ(pool.cached_bytes(), 0u);
  }
  EXPECT_GE(pool.cached_bytes(), 100000u);
  auto b = pool.get(99000);  // rounds to the same 4 KB multiple
  EXPECT_EQ(b.get(), first);
  EXPECT_EQ(pool.cached_bytes(), 0u);
  // Two live blocks are distinct.
  auto c = pool.get(99000);
  EXPECT_NE(c.get(), b.get());
}

TEST(ScratchPool, NeverHandsOutABlockMoreThanTwiceTheRequest) {
  mb::ScratchPool pool;
  void* big = nullptr;
  {
    auto a = pool.get(1 << 20);
    big = a.get();
  }
  auto small = pool.get(4096);
  EXPECT_NE(small.get(), big);
  EXPECT_GE(pool.cached_bytes(), size_t(1) << 20);  // the large block stays for a large request
  auto large = pool.get((1 << 20) - 8192);
  EXPECT_EQ(large.get(), big);
}

TEST(ScratchPool, KeepsNoMoreThanItsCap) {
  mb::ScratchPool pool(64 * 1024);
  {
    auto a = pool.get(40 * 1024), b = pool.get(40 * 1024);
  }
  EXPECT_LE(pool.cached_bytes(), 64u * 1024);
  EXPECT_GT(pool.cached_bytes(), 0u);
}

TEST(ScratchPool, BlocksOutliveThePool) {
  std::shared_ptr<void> block;
  {
    mb::ScratchPool pool;
    block = pool.get(1 << 16);
    std::memset(block.get(), 1, 1 << 16);
  }
  // The pool object is gone and the block is still ours alone, its bytes intact (a block freed
  // with the pool would be overwritten, or a use-after-free report under ASan); dropping it
  // then frees it cleanly (a leak or double free under ASan otherwise).
  EXPECT_EQ(block.use_count(), 1);
  const auto* bytes = static_cast<const uint8_t*>(block.get());
  EXPECT_TRUE(std::all_of(bytes, bytes + (1 << 16), [](uint8_t b) { return b == 1; }));
  block.reset();
}

TEST(ScratchPool, PoisonFillsEveryBlockWithNaNBytes) {
  PoisonGuard guard;
  mb::ScratchPool::set_poison(true);
  mb::ScratchPool pool;
  {
    auto a = pool.get(256);
    std::memset(a.get(), 0, 256);
  }
  auto b = pool.get(256);
  const float* f = static_cast<const float*>(b.get());
  for (int i = 0; i < 64; ++i) ASSERT_TRUE(std::isnan(f[i])) << i;
}

std::vector<float> forward_logits(mb::Backend& be, const std::shared_ptr<const mb::Checkpoint>& ck, int steps) {
  auto model = mb::load_model(ck, be, {});
  mb::KVCache kv(ck->config, be, {1, 64, 16});
  // A prompt of 9 tokens, then single-token steps: prefill and decode shapes both run.
  mb::Batch b;
  for (int i = 0; i < 9; ++i) {
    b.tokens.push_back(3 + 7 * i);
    b.positions.push_back(i);
    b.logit_rows.push_back(i);
  }
  b.seqs.push_back({0, 0, 9});
  std::vector<float> all, out;
  model->forward(b, kv, out);
  all.insert(all.end(), out.begin(), out.end());
  for (int s = 0; s < steps; ++s) {
    mb::Batch d;
    d.tokens = {int32_t(11 + s)};
    d.positions = {9 + s};
    d.logit_rows = {0};
    d.seqs.push_back({0, 0, 1});
    model->forward(d, kv, out);
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

TEST(Scratch, PoisonedActivationsGiveTheSameLogits) {
  PoisonGuard guard;
  for (mb::DType dt : {mb::DType::F32, mb::DType::Q4_0, mb::DType::Q8_0}) {
    auto ck = mb::make_synthetic_checkpoint("tiny", dt);
    mb::ScratchPool::set_poison(false);
    auto be = mb::make_cpu_backend();
    const std::vector<float> clean = forward_logits(*be, ck, 3);
    mb::ScratchPool::set_poison(true);
    auto be2 = mb::make_cpu_backend();
    const std::vector<float> poisoned = forward_logits(*be2, ck, 3);
    ASSERT_EQ(clean.size(), poisoned.size());
    for (size_t i = 0; i < clean.size(); ++i) {
      ASSERT_TRUE(std::isfinite(poisoned[i])) << mb::dtype_name(dt) << " logit " << i;
      ASSERT_EQ(clean[i], poisoned[i]) << mb::dtype_name(dt) << " logit " << i;
    }
  }
}

TEST(ProfilingBackend, ChangesNoNumberAndCountsEveryOp) {
  auto ck = mb::make_synthetic_checkpoint("tiny", mb::DType::Q4_0);
  auto plain = mb::make_cpu_backend();
  const std::vector<float> want = forward_logits(*plain, ck, 2);

  auto inner = mb::make_cpu_backend();
  mb::ProfilingBackend prof(*inner);
  prof.set_enabled(true);
  const std::vector<float> got = forward_logits(prof, ck, 2);
  ASSERT_EQ(want, got);

  const auto entries = prof.entries();
  ASSERT_FALSE(entries.empty());
  std::set<std::string> ops;
  double weight_bytes = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_GT(entries[i].calls, 0) << entries[i].label;
    EXPECT_GE(entries[i].seconds, 0) << entries[i].label;
    if (i > 0) {
      EXPECT_GE(entries[i - 1].seconds, entries[i].seconds);  // sorted, most first
    }
    ops.insert(entries[i].label.substr(0, entries[i].label.find(' ')));
    weight_bytes += entries[i].weight_bytes;
  }
  for (const char* op : {"matmul", "attention", "embed", "scratch", "rms_norm"}) EXPECT_TRUE(ops.count(op)) << op;
  EXPECT_GT(weight_bytes, 0);

  // Disabled: nothing is recorded; reset drops what was.
  prof.reset();
  prof.set_enabled(false);
  forward_logits(prof, ck, 1);
  EXPECT_TRUE(prof.entries().empty());
}

TEST(ProfilingBackend, HostTimeIsARowOutsideTheOpsTotal) {
  auto inner = mb::make_cpu_backend();
  mb::ProfilingBackend prof(*inner);
  { const mb::HostTimer t(prof, "ignored while disabled"); }
  EXPECT_TRUE(prof.entries().empty());
  prof.set_enabled(true);
  prof.host_time("images decoded", 0.5);
  prof.host_time("images decoded", 0.25);
  mb::Tensor x = prof.alloc(mb::DType::F32, {4});
  const std::vector<float> v = {1, 2, 3, 4};
  prof.upload(v.data(), x);
  const auto entries = prof.entries();
  const auto host = std::find_if(entries.begin(), entries.end(), [](const auto& e) { return e.host; });
  ASSERT_NE(host, entries.end());
  EXPECT_EQ(host->label, "(host) images decoded");
  EXPECT_EQ(host->calls, 2);
  EXPECT_DOUBLE_EQ(host->seconds, 0.75);
  // The title's total is the ops' alone: far below the host row's 0.75 s.
  const std::string table = prof.table("t");
  EXPECT_NE(table.find("(host) images decoded"), std::string::npos) << table;
  EXPECT_EQ(table.find("t: 0.7"), std::string::npos) << table;
  EXPECT_NE(table.find("t: 0.0"), std::string::npos) << table;
}

TEST(Bench, ProfilePrintsAPrefillAndADecodeTable) {
  auto r = mbtest::run_cli("bench --synthetic tiny --dtype q8_0 --pp 8 --tg 4 --reps 2 --batch 1,2 --profile");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* s : {"prefill profile, batch 1", "decode profile, batch 1", "decode profile, batch 2",
                        "matmul", "weight GB/s", "attention"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  r = mbtest::run_cli("bench --synthetic tiny --pp 0 --tg 2 --reps 1 --profile");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("prefill profile"), std::string::npos) << r.out;  // no prefill ran
  EXPECT_NE(r.out.find("decode profile"), std::string::npos) << r.out;
}

}  // namespace
