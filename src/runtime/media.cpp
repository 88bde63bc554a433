#include "runtime/media.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "models/architecture.h"

namespace mb {

namespace {
// Soft tokens kept for reuse: enough for a conversation's images (E4B: 280 x 2560 floats an image).
constexpr size_t kKeptFloats = size_t(64) << 20;

const char* kind_name(MediaItem::Kind k) { return k == MediaItem::Kind::Image ? "image" : "audio clip"; }

std::string ordinal(size_t i) {
  const size_t n = i + 1;
  const char* suffix = (n % 100 >= 11 && n % 100 <= 13) ? "th" : n % 10 == 1 ? "st" : n % 10 == 2 ? "nd" : n % 10 == 3 ? "rd" : "th";
  return std::to_string(n) + suffix;
}
}  // namespace

uint64_t media_hash(const MediaItem& item) {
  // FNV-1a over the bytes, then a splitmix finaliser; the kind is the seed.
  uint64_t h = 1469598103934665603ull ^ uint64_t(item.kind == MediaItem::Kind::Image ? 0x1a : 0x2b);
  for (uint8_t b : item.bytes) h = (h ^ b) * 1099511628211ull;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

PromptMedia::PromptMedia(std::string model_path, Backend& backend) : path_(std::move(model_path)), backend_(backend) {}
PromptMedia::~PromptMedia() = default;

MediaEncoder& PromptMedia::encoder() {
  if (!encoder_) {
    ck_ = open_checkpoint(path_, {.load_multimodal = true});
    encoder_ = ck_->architecture().make_media_encoder(ck_, backend_);
  }
  return *encoder_;
}

const MediaTokenIds& PromptMedia::token_ids() {
  std::lock_guard<std::mutex> lock(mu_);
  return encoder().token_ids();
}

PromptMedia::Encoded PromptMedia::encode(const MediaItem& item) {
  MB_CHECK(!item.bytes.empty(), "{}: the file is empty", item.what);
  const uint64_t hash = media_hash(item);
  for (auto it = recent_.begin(); it != recent_.end(); ++it)
    if (it->hash == hash) {
      recent_.splice(recent_.begin(), recent_, it);
      return recent_.front();
    }
  MediaEncoder& enc = encoder();
  auto soft = std::make_shared<std::vector<float>>(enc.encode(item));
  const int64_t width = enc.hidden_size();
  MB_CHECK(width > 0 && !soft->empty() && int64_t(soft->size()) % width == 0,
           "{}: the encoder gave {} values, not whole soft tokens of {}", item.what, soft->size(), width);
  for (float v : *soft) MB_CHECK(std::isfinite(v), "{}: the encoder's soft tokens are not finite", item.what);
  Encoded e{hash, soft, int64_t(soft->size()) / width};
  recent_.push_front(e);
  recent_floats_ += soft->size();
  while (recent_floats_ > kKeptFloats && recent_.size() > 1) {
    recent_floats_ -= recent_.back().soft->size();
    recent_.pop_back();
  }
  return e;
}

std::vector<MediaSpan> PromptMedia::place(std::vector<int32_t>& prompt, const std::vector<MediaItem>& items,
                                          int32_t bos_id, bool rendered) {
  std::vector<MediaSpan> spans;
  if (items.empty()) return spans;
  std::lock_guard<std::mutex> lock(mu_);
  const MediaTokenIds ids = encoder().token_ids();
  std::vector<Encoded> encoded;
  for (const MediaItem& it : items) encoded.push_back(encode(it));

  struct KindIds {
    MediaItem::Kind kind;
    int32_t placeholder, begin, end;
  };
  for (const KindIds k : {KindIds{MediaItem::Kind::Image, ids.image, ids.image_begin, ids.image_end},
                          KindIds{MediaItem::Kind::Audio, ids.audio, ids.audio_begin, ids.audio_end}}) {
    std::vector<size_t> mine;
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].kind == k.kind) mine.push_back(i);
    if (mine.empty()) continue;
    MB_CHECK(k.placeholder >= 0, "this model has no {} placeholder token", kind_name(k.kind));
    if (std::find(prompt.begin(), prompt.end(), k.placeholder) == prompt.end()) {
      const size_t at = !prompt.empty() && prompt[0] == bos_id ? 1 : 0;
      prompt.insert(prompt.begin() + std::ptrdiff_t(at), mine.size(), k.placeholder);
    }
    // Runs of placeholders, in order; each takes the next item of this kind.
    size_t next = 0;
    for (size_t p = 0; p < prompt.size();) {
      if (prompt[p] != k.placeholder) {
        ++p;
        continue;
      }
      size_t e = p + 1;
      while (!rendered && e < prompt.size() && prompt[e] == k.placeholder) ++e;
      MB_CHECK(next < mine.size(), "the prompt has more {} placeholder runs than the {} {}(s) given",
               kind_name(k.kind), mine.size(), kind_name(k.kind));
      const Encoded& m = encoded[mine[next]];
      const MediaItem& item = items[mine[next]];
      const int64_t run = int64_t(e - p);
      if (run == 1 && m.tokens != 1) {
        std::vector<int32_t> fill;
        if (p == 0 || prompt[p - 1] != k.begin) fill.push_back(k.begin);
        fill.insert(fill.end(), size_t(m.tokens), k.placeholder);
        if (e == prompt.size() || prompt[e] != k.end) fill.push_back(k.end);
        prompt.erase(prompt.begin() + std::ptrdiff_t(p));
        prompt.insert(prompt.begin() + std::ptrdiff_t(p), fill.begin(), fill.end());
        if (fill.front() == k.begin) ++p;
        e = p + size_t(m.tokens);
      } else {
        MB_CHECK(run == m.tokens,
                 "the {} {} ({}) gives {} soft tokens but its placeholder run in the prompt has {} (give one "
                 "placeholder to have it expanded)",
                 ordinal(next), kind_name(k.kind), item.what, m.tokens, run);
      }
      p = e;
      ++next;
    }
    MB_CHECK(next == mine.size(), "{} {}(s) given but the prompt has {} placeholder run(s) for them", mine.size(),
             kind_name(k.kind), next);
  }
  // Spans from the final prompt (expanding one kind's runs moves the other's).
  std::vector<size_t> taken(2, 0);
  for (size_t p = 0; p < prompt.size();) {
    const bool image = prompt[p] == ids.image, audio = prompt[p] == ids.audio;
    if (!image && !audio) {
      ++p;
      continue;
    }
    size_t e = p;
    while (e < prompt.size() && prompt[e] == prompt[p]) ++e;
    const MediaItem::Kind kind = image ? MediaItem::Kind::Image : MediaItem::Kind::Audio;
    size_t& k = taken[image ? 0 : 1];
    size_t seen = 0, i = 0;
    for (; i < items.size(); ++i)
      if (items[i].kind == kind && seen++ == k) break;
    MB_CHECK(i < items.size(), "the prompt has more {} placeholder runs than {}(s) given", kind_name(kind),
             kind_name(kind));
    ++k;
    spans.push_back({int64_t(p), int64_t(e - p), encoded[i].soft, encoded[i].hash, image});
    p = e;
  }
  return spans;
}

}  // namespace mb
