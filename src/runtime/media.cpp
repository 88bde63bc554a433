#include "runtime/media.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/thread_pool.h"
#include "models/architecture.h"

namespace mb {

namespace {
// Soft tokens kept for reuse: enough for a conversation's images (E4B: 280 x 2560 floats an image).
constexpr size_t kKeptFloats = size_t(64) << 20;

const char* kind_name(MediaItem::Kind k) {
  return k == MediaItem::Kind::Image ? "image" : k == MediaItem::Kind::Audio ? "audio clip" : "video";
}

uint64_t mix(uint64_t h) {  // splitmix64's finaliser
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

std::string ordinal(size_t i) {
  const size_t n = i + 1;
  const char* suffix = (n % 100 >= 11 && n % 100 <= 13) ? "th" : n % 10 == 1 ? "st" : n % 10 == 2 ? "nd" : n % 10 == 3 ? "rd" : "th";
  return std::to_string(n) + suffix;
}
}  // namespace

uint64_t media_hash(const MediaItem& item) {
  // FNV-1a over the bytes (a video's frames each followed by a separator), then a splitmix finaliser; the kind
  // is the seed.
  const uint64_t seed = item.kind == MediaItem::Kind::Image ? 0x1a : item.kind == MediaItem::Kind::Audio ? 0x2b : 0x3c;
  uint64_t h = 1469598103934665603ull ^ seed;
  for (uint8_t b : item.bytes) h = (h ^ b) * 1099511628211ull;
  for (const auto& frame : item.frames) {
    for (uint8_t b : frame) h = (h ^ b) * 1099511628211ull;
    h = (h ^ 0x100) * 1099511628211ull;
  }
  return mix(h);
}

PromptMedia::PromptMedia(std::string model_path, CheckpointOptions opts, Backend& backend)
    : path_(std::move(model_path)), opts_(std::move(opts)), backend_(backend) {}
PromptMedia::~PromptMedia() = default;

MediaEncoder& PromptMedia::encoder() {
  if (!encoder_) {
    const HostTimer timer(backend_, "media checkpoint opened");
    ck_ = open_checkpoint(path_, opts_);
    encoder_ = ck_->architecture().make_media_encoder(ck_, backend_);
  }
  return *encoder_;
}

std::vector<PromptMedia::Encoded> PromptMedia::encode(const std::vector<MediaItem>& items) {
  std::vector<Encoded> out(items.size());
  std::vector<uint64_t> hashes(items.size());
  std::vector<const MediaItem*> todo;
  std::vector<size_t> todo_at, same_as(items.size(), SIZE_MAX);
  for (const MediaItem& item : items)
    MB_CHECK(!item.bytes.empty() || !item.frames.empty(), "{}: the file is empty", item.what);
  {
    // Side by side: a byte at a time, a 2 MB photo is ~2.5 ms of one core.
    const HostTimer timer(backend_, "media hashed");
    ThreadPool::global().parallel_for(int64_t(items.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hashes[size_t(i)] = media_hash(items[size_t(i)]);
    });
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const MediaItem& item = items[i];
    bool kept = false;
    for (auto it = recent_.begin(); it != recent_.end(); ++it)
      if (it->hash == hashes[i]) {
        recent_.splice(recent_.begin(), recent_, it);
        out[i] = recent_.front();
        kept = true;
        break;
      }
    if (kept) continue;
    for (size_t j : todo_at)
      if (hashes[j] == hashes[i]) same_as[i] = j;  // the same file twice in one request: encoded once
    if (same_as[i] != SIZE_MAX) continue;
    todo.push_back(&item);
    todo_at.push_back(i);
  }
  if (!todo.empty()) {
    std::vector<MediaEncoding> m = encoder().encode_batch(todo);
    MB_CHECK(m.size() == todo.size(), "the media encoder gave {} results for {} items", m.size(), todo.size());
    const HostTimer timer(backend_, "soft tokens checked and kept");
    for (size_t k = 0; k < todo.size(); ++k) out[todo_at[k]] = keep(hashes[todo_at[k]], std::move(m[k]), *todo[k]);
  }
  for (size_t i = 0; i < items.size(); ++i)
    if (same_as[i] != SIZE_MAX) out[i] = out[same_as[i]];
  return out;
}

PromptMedia::Encoded PromptMedia::keep(uint64_t hash, MediaEncoding&& m, const MediaItem& item) {
  const int64_t width = encoder().hidden_size();
  int64_t total = 0;
  for (const MediaEncoding::Block& b : m.blocks) {
    MB_CHECK(b.tokens > 0, "{}: the encoder gave an empty block", item.what);
    total += b.tokens;
  }
  MB_CHECK(width > 0 && !m.blocks.empty() && int64_t(m.soft.size()) == total * width,
           "{}: the encoder gave {} values, not its {} soft tokens of {}", item.what, m.soft.size(), total, width);
  // A value is not finite where its exponent bits are all set; an OR over them vectorizes where a loop that
  // stops at the first would not.
  uint32_t non_finite = 0;
  for (float v : m.soft) non_finite |= uint32_t((std::bit_cast<uint32_t>(v) & 0x7f800000u) == 0x7f800000u);
  MB_CHECK(!non_finite, "{}: the encoder's soft tokens are not finite", item.what);
  Encoded e{hash, {}, m.soft.size()};
  const float* at = m.soft.data();
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const size_t n = size_t(m.blocks[i].tokens) * size_t(width);
    auto soft = m.blocks.size() == 1 ? std::make_shared<const std::vector<float>>(std::move(m.soft))
                                     : std::make_shared<const std::vector<float>>(at, at + n);
    at += n;
    e.blocks.push_back({std::move(soft), m.blocks[i].tokens, m.blocks[i].label,
                        m.blocks.size() == 1 ? hash : mix(hash + 0x9e3779b97f4a7c15ull * (i + 1))});
  }
  recent_.push_front(e);
  recent_floats_ += e.floats;
  while (recent_floats_ > kKeptFloats && recent_.size() > 1) {
    recent_floats_ -= recent_.back().floats;
    recent_.pop_back();
  }
  return e;
}

std::vector<MediaSpan> PromptMedia::place(std::vector<int32_t>& prompt, const std::vector<MediaItem>& items,
                                          int32_t bos_id, bool rendered, const Tokenize& tokenize) {
  std::vector<MediaSpan> spans;
  if (items.empty()) return spans;
  std::lock_guard<std::mutex> lock(mu_);
  const MediaTokenIds ids = encoder().token_ids();
  const std::vector<Encoded> encoded = encode(items);

  struct KindIds {
    MediaItem::Kind kind;
    int32_t placeholder, begin, end;
  };
  const KindIds kinds[] = {{MediaItem::Kind::Image, ids.image, ids.image_begin, ids.image_end},
                           {MediaItem::Kind::Audio, ids.audio, ids.audio_begin, ids.audio_end},
                           {MediaItem::Kind::Video, ids.video, ids.image_begin, ids.image_end}};
  std::vector<std::vector<const Block*>> blocks_of(3);  // per kind, every item's blocks in order
  for (size_t kind_i = 0; kind_i < 3; ++kind_i) {
    const KindIds k = kinds[kind_i];
    const bool video = k.kind == MediaItem::Kind::Video;
    std::vector<size_t> mine;
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].kind == k.kind) mine.push_back(i);
    if (mine.empty()) continue;
    for (size_t i : mine)
      for (const Block& b : encoded[i].blocks) blocks_of[kind_i].push_back(&b);
    MB_CHECK(k.placeholder >= 0, "this model has no {} placeholder token", kind_name(k.kind));
    bool singles = rendered;  // every placeholder is one item
    if (std::find(prompt.begin(), prompt.end(), k.placeholder) == prompt.end()) {
      const size_t at = !prompt.empty() && prompt[0] == bos_id ? 1 : 0;
      prompt.insert(prompt.begin() + std::ptrdiff_t(at), mine.size(), k.placeholder);
      singles = true;
    }
    // Runs of placeholders, in order; each is a whole item to expand, or the next block of the current one.
    size_t next = 0, block = 0;
    for (size_t p = 0; p < prompt.size();) {
      if (prompt[p] != k.placeholder) {
        ++p;
        continue;
      }
      size_t e = p + 1;
      while (!singles && e < prompt.size() && prompt[e] == k.placeholder) ++e;
      MB_CHECK(next < mine.size(), "the prompt has more {} placeholder runs than the {} {}(s) given",
               kind_name(k.kind), mine.size(), kind_name(k.kind));
      const Encoded& m = encoded[mine[next]];
      const MediaItem& item = items[mine[next]];
      const int64_t run = int64_t(e - p);
      const bool one_token = m.blocks.size() == 1 && m.blocks[0].tokens == 1;
      if (block == 0 && run == 1 && !one_token) {
        std::vector<int32_t> fill;
        for (size_t b = 0; b < m.blocks.size(); ++b) {
          if (video) {
            MB_CHECK(tokenize != nullptr, "{}: a video needs the model's tokenizer (its frames' timestamps are text)",
                     item.what);
            const std::vector<int32_t> t = tokenize(b == 0 ? m.blocks[b].label + " " : " " + m.blocks[b].label + " ");
            fill.insert(fill.end(), t.begin(), t.end());
          }
          if (video || p == 0 || prompt[p - 1] != k.begin) fill.push_back(k.begin);
          fill.insert(fill.end(), size_t(m.blocks[b].tokens), k.placeholder);
          if (video || e == prompt.size() || prompt[e] != k.end) fill.push_back(k.end);
        }
        prompt.erase(prompt.begin() + std::ptrdiff_t(p));
        prompt.insert(prompt.begin() + std::ptrdiff_t(p), fill.begin(), fill.end());
        p += fill.size();
        ++next;
        continue;
      }
      MB_CHECK(run == m.blocks[block].tokens,
               "the {} {} ({}) gives {} soft tokens{} but its placeholder run in the prompt has {} (give one "
               "placeholder to have it expanded)",
               ordinal(next), kind_name(k.kind), item.what, m.blocks[block].tokens,
               m.blocks.size() > 1 ? fmt::format(" in its {} frame", ordinal(block)) : std::string(), run);
      p = e;
      if (++block == m.blocks.size()) {
        block = 0;
        ++next;
      }
    }
    MB_CHECK(block == 0, "the prompt has placeholder runs for {} of the {} frames of the {} video", block,
             encoded[mine[next]].blocks.size(), ordinal(next));
    MB_CHECK(next == mine.size(), "{} {}(s) given but the prompt has {} placeholder run(s) for them", mine.size(),
             kind_name(k.kind), next);
  }
  // Spans from the final prompt (expanding one kind's runs moves the others').
  std::vector<size_t> taken(3, 0);
  for (size_t p = 0; p < prompt.size();) {
    size_t kind_i = 0;
    while (kind_i < 3 && (blocks_of[kind_i].empty() || prompt[p] != kinds[kind_i].placeholder)) ++kind_i;
    if (kind_i == 3) {
      ++p;
      continue;
    }
    size_t e = p;
    while (e < prompt.size() && prompt[e] == prompt[p]) ++e;
    size_t& k = taken[kind_i];
    MB_CHECK(k < blocks_of[kind_i].size(), "the prompt has more {} placeholder runs than {}(s) given",
             kind_name(kinds[kind_i].kind), kind_name(kinds[kind_i].kind));
    const Block& b = *blocks_of[kind_i][k++];
    MB_CHECK(int64_t(e - p) == b.tokens, "a {} placeholder run of {} where {} soft tokens go",
             kind_name(kinds[kind_i].kind), e - p, b.tokens);
    spans.push_back({int64_t(p), int64_t(e - p), b.soft, b.hash, kinds[kind_i].kind != MediaItem::Kind::Audio});
    p = e;
  }
  return spans;
}

}  // namespace mb
