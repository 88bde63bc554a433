// What a forward call hands a backend before its ops (models/model.cpp step_inputs): the host
// arrays it stages and the key a decode step may be recorded under (CUDA graphs). A recording
// replays for every later step with its key, so the key must change with anything the ops take
// but the staged data, and stay put as positions advance.
#include <gtest/gtest.h>

#include "backends/profiling_backend.h"
#include "models/model.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_pages.h"
#include "test_util.h"

namespace {

// The CPU backend, claiming it records steps (so that step_inputs gives keys).
class RecordingCpu : public mb::ProfilingBackend {
 public:
  explicit RecordingCpu(mb::Backend& inner) : ProfilingBackend(inner) {}
  bool can_record_steps() const override { return true; }
};

mb::Batch decode(int n_seqs, int32_t pos) {
  mb::Batch b;
  for (int s = 0; s < n_seqs; ++s) {
    b.tokens.push_back(7 + s);
    b.positions.push_back(pos);
    b.seqs.push_back({s, s, 1});
    b.logit_rows.push_back(s);
  }
  return b;
}

TEST(StepInputs, DecodeKeysFollowTheShapeNotThePositions) {
  auto ck = mb::open_checkpoint(mbtest::fixture("e2b_like"));
  auto cpu = mb::make_cpu_backend();
  RecordingCpu be(*cpu);
  mb::KVCache kv(ck->config, be, {4, 2048, 16});
  const uint64_t k10 = mb::step_inputs(decode(2, 10), kv, ck->config, be).record_key;
  EXPECT_NE(k10, 0u);
  EXPECT_EQ(mb::step_inputs(decode(2, 11), kv, ck->config, be).record_key, k10) << "a position within the bucket";
  EXPECT_EQ(mb::step_inputs(decode(2, 255), kv, ck->config, be).record_key, k10);
  EXPECT_NE(mb::step_inputs(decode(2, 256), kv, ck->config, be).record_key, k10) << "the next 256 positions";
  EXPECT_NE(mb::step_inputs(decode(3, 10), kv, ck->config, be).record_key, k10) << "another batch size";
  mb::Batch other_slot = decode(2, 10);
  other_slot.seqs[1].kv_slot = 3;  // another sequence's KV store
  EXPECT_NE(mb::step_inputs(other_slot, kv, ck->config, be).record_key, k10);
  mb::Batch fewer_rows = decode(2, 10);
  fewer_rows.logit_rows = {1};
  EXPECT_NE(mb::step_inputs(fewer_rows, kv, ck->config, be).record_key, k10);

  // A prefill is not recorded; nor is anything on a backend that cannot record.
  mb::Batch prefill;
  prefill.tokens = {2, 3, 4};
  prefill.positions = {0, 1, 2};
  prefill.seqs = {{0, 0, 3}};
  prefill.logit_rows = {2};
  EXPECT_EQ(mb::step_inputs(prefill, kv, ck->config, be).record_key, 0u);
  EXPECT_EQ(mb::step_inputs(decode(2, 10), kv, ck->config, *cpu).record_key, 0u);
}

TEST(StepInputs, ArraysAreTheBatchThenEachPageTableWithRoomToGrow) {
  auto ck = mb::open_checkpoint(mbtest::fixture("e2b_like"));
  const mb::ModelConfig& c = ck->config;
  auto cpu = mb::make_cpu_backend();
  RecordingCpu be(*cpu);
  mb::KVPageOptions po;
  po.page_tokens = 4;
  po.max_context = 64;
  po.max_step = 16;
  po.max_seqs = 2;
  po.bytes = mb::KVPageManager::min_bytes(c, po) * 2;
  mb::KVPageManager pages(c, *cpu, po);
  mb::SeqPages a, b;
  ASSERT_TRUE(pages.reserve(a, 0, 10));
  ASSERT_TRUE(pages.reserve(b, 0, 3));
  mb::PagedKVView view(pages, c, 64, 16);
  view.set({&a, &b});
  mb::Batch batch = decode(2, 9);
  batch.positions[1] = 2;
  const mb::StepInputs in = mb::step_inputs(batch, view, c, be);
  ASSERT_GE(in.arrays.size(), 3u);
  EXPECT_EQ(in.arrays[0].data, batch.tokens.data());
  EXPECT_EQ(in.arrays[1].data, batch.positions.data());
  EXPECT_EQ(in.arrays[2].data, batch.logit_rows.data());
  // Each sequence's table of each group once, in order, with room for 64 / 4 pages.
  size_t tables = 0, last_a = 0, first_b = 0;
  for (size_t i = 3; i < in.arrays.size(); ++i) {
    const mb::HostArray& t = in.arrays[i];
    const bool of_a = t.data == a.table[0].data() || t.data == a.table[1].data();
    const bool of_b = t.data == b.table[0].data() || t.data == b.table[1].data();
    EXPECT_TRUE(of_a != of_b) << "table " << i << " belongs to exactly one sequence";
    if (of_a) last_a = i;
    if (of_b && first_b == 0) first_b = i;
    EXPECT_EQ(t.reserve, size_t(64 / 4) * sizeof(int32_t));
    EXPECT_LE(t.bytes, t.reserve);
    for (size_t j = 3; j < i; ++j) EXPECT_NE(in.arrays[j].data, t.data) << "a table staged twice";
    ++tables;
  }
  EXPECT_GE(tables, 2u);
  EXPECT_LT(last_a, first_b) << "sequence 0's tables come first";
  // A table that grows keeps the layout (and the key) of the step.
  auto held = [](const mb::SeqPages& s) {
    int n = 0;
    for (const auto& t : s.table)
      for (int32_t p : t) n += p >= 0;
    return n;
  };
  const int pages_before = held(a);
  ASSERT_TRUE(pages.reserve(a, 10, 13));
  EXPECT_GT(held(a), pages_before);
  view.set({&a, &b});
  batch.positions[0] = 12;
  const mb::StepInputs later = mb::step_inputs(batch, view, c, be);
  EXPECT_EQ(later.record_key, in.record_key);
  ASSERT_EQ(later.arrays.size(), in.arrays.size());
  for (size_t i = 0; i < in.arrays.size(); ++i) EXPECT_EQ(later.arrays[i].reserve, in.arrays[i].reserve);
}

}  // namespace
