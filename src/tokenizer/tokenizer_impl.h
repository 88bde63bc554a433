// Internal tables of mb::Tokenizer, shared by tokenizer.cpp (build, encode, decode) and
// tokenizer_hf_json.cpp (tokenizer.json reader). Not part of the public API.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/utf8.h"

namespace mb::tok_detail {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (s.size() * 0x100000001b3ULL);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ mix64(w)) * 0x9E3779B97F4A7C15ULL;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  return mix64(h ^ w);
}

// Open-addressing map from uint64 keys to a 64-bit payload; keys must not be ~0.
class U64Map {
 public:
  static constexpr uint64_t kEmpty = ~0ULL;
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 3 / 2) cap <<= 1;
    slots_.assign(cap, Slot{kEmpty, 0});
    mask_ = cap - 1;
    size_ = 0;
  }
  void prefetch(uint64_t key) const { __builtin_prefetch(&slots_[mix64(key) & mask_]); }
  // Keeps the first value for a key, like a map insert.
  bool insert(uint64_t key, uint64_t value) {
    if ((size_ + 1) * 3 > slots_.size() * 2) grow();
    size_t i = mix64(key) & mask_;
    while (slots_[i].key != kEmpty) {
      if (slots_[i].key == key) return false;
      i = (i + 1) & mask_;
    }
    slots_[i] = Slot{key, value};
    ++size_;
    return true;
  }
  void assign(uint64_t key, uint64_t value) {
    if (!insert(key, value)) {
      size_t i = mix64(key) & mask_;
      while (slots_[i].key != key) i = (i + 1) & mask_;
      slots_[i].value = value;
    }
  }
  const uint64_t* find(uint64_t key) const {
    if (slots_.empty()) return nullptr;
    size_t i = mix64(key) & mask_;
    for (;;) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.value;
      if (s.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t key;
    uint64_t value;
  };
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    reserve(old.empty() ? 8 : old.size() * 2);
    for (const Slot& s : old)
      if (s.key != kEmpty) insert(s.key, s.value);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// String -> id map whose keys live in a caller-owned pool, addressed by offset so that a slot
// can be verified with one memory access (loading Gemma's vocabulary is dominated by misses).
class PieceMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{0, 0, 0, -1});
    mask_ = cap - 1;
  }
  // Keeps the first id for a key; `key` must equal base[off, off + key.size()).
  bool insert(std::string_view key, uint32_t off, int32_t id, const char* base) {
    return insert(key, hash_bytes(key), off, id, base);
  }
  bool insert(std::string_view key, uint64_t h, uint32_t off, int32_t id, const char* base) {
    size_t i = h & mask_;
    while (slots_[i].id >= 0) {
      if (match(slots_[i], h, key, base)) return false;
      i = (i + 1) & mask_;
    }
    slots_[i] = Slot{h, off, static_cast<uint32_t>(key.size()), id};
    return true;
  }
  int32_t find(std::string_view key, uint64_t h, const char* base) const {
    if (slots_.empty()) return -1;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (match(s, h, key, base)) return s.id;
    }
  }
  int32_t find(std::string_view key, const char* base) const { return find(key, hash_bytes(key), base); }
  // Two-stage prefetch for batched lookups: the slot, then the key bytes it points at.
  void prefetch_slot(uint64_t h) const { __builtin_prefetch(&slots_[h & mask_]); }
  void prefetch_key(uint64_t h, const char* base) const {
    __builtin_prefetch(base + slots_[h & mask_].off);
  }

 private:
  struct Slot {
    uint64_t hash;
    uint32_t off, len;
    int32_t id;
  };
  static bool match(const Slot& s, uint64_t h, std::string_view key, const char* base) {
    return s.hash == h && s.len == key.size() && std::memcmp(base + s.off, key.data(), key.size()) == 0;
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

// The `\w` class (Unicode) of HF's single_word check; table in tokenizer_unicode.cpp.
bool is_word_char(uint32_t cp);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// Byte trie over added-token contents, walked for leftmost-longest matches.
struct AddedTrie {
  struct Node {
    uint32_t first_edge = 0;
    uint32_t n_edges = 0;
    int32_t token = -1;  // index into Impl::added
  };
  struct Edge {
    uint8_t byte;
    uint32_t child;
  };
  std::vector<Node> nodes;
  std::vector<Edge> edges;
  std::array<bool, 256> first_byte{};
  bool empty() const { return nodes.size() <= 1; }
  void build(const std::vector<AddedToken>& added, bool normalized_set,
             const std::vector<std::string>& contents);
  // Longest token starting at s[0]; returns its length (0: none) and the token index.
  size_t longest(std::string_view s, int32_t* token) const;
};

struct NormStep {
  enum Kind { Replace, Prepend } kind;
  std::string pattern;  // Replace only
  std::string content;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct DecodeStrip {
  std::string content;  // one UTF-8 character
  int start = 0;
  int stop = 0;
};

struct Impl {
  // Vocabulary: model pieces plus added tokens, by id.
  // Model strings by id, then the text of added tokens whose id has none or another one.
  std::string pool;
  struct Span {
    uint32_t off, len;
  };
  std::vector<Span> pieces;
  std::vector<uint8_t> flags;       // kValid | kSpecial | kAdded | kByte
  static constexpr uint8_t kValid = 1, kSpecial = 2, kAdded = 4, kByte = 8;
  PieceMap model_index;  // model vocabulary only, as HF's BPE model sees it
  PieceMap added_index;  // added-token contents
  int32_t n_model = 0;

  // BPE model.
  std::vector<int32_t> char_id;        // code point -> id of the single-char model piece
  std::array<int32_t, 256> byte_id{};  // <0xXX> tokens, -1 if absent
  U64Map merges;                       // (left << 32 | right) -> (rank << 32 | merged id)
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  int32_t unk = -1;

  // Word splitting that provably cannot change the BPE result (see tokenizer.cpp).
  bool chunking = false;
  std::vector<uint8_t> cp_flags;  // kEndsLeft | kStartsRight | kCut, by code point
  static constexpr uint8_t kEndsLeft = 1, kStartsRight = 2, kCut = 4;
  U64Map cross;  // (last cp of a merge's left << 21 | first cp of its right)

  // Added tokens.
  std::vector<AddedToken> added;
  AddedTrie raw_trie;   // normalized == false: matched on the raw text
  AddedTrie norm_trie;  // normalized == true: matched on the normalized text

  std::vector<NormStep> normalizer;
  bool has_split = false;
  std::string split_pattern;
  SplitBehavior split_behavior = SplitBehavior::Removed;

  // Decoder: per-id text after the per-token steps, then byte fallback, then a final Strip.
  bool has_decoder = false;
  bool dec_byte_fallback = false;
  std::string dec_pool;
  std::vector<uint32_t> dec_off;
  std::vector<int16_t> dec_byte;  // byte value of a <0xXX> token after per-token steps, or -1
  DecodeStrip final_strip;

  int32_t bos = -1, eos = -1, pad = -1;
  bool post_adds_bos = false;

  std::string_view piece(int32_t id) const { return {pool.data() + pieces[id].off, pieces[id].len}; }
  std::string_view dec_text(int32_t id) const {
    return std::string_view(dec_pool).substr(dec_off[id], dec_off[id + 1] - dec_off[id]);
  }
  int32_t size() const { return static_cast<int32_t>(flags.size()); }
  bool valid(int32_t id) const { return id >= 0 && id < size() && (flags[id] & kValid); }
};

// What a tokenizer.json or GGUF reader hands to build(): strings may point into the source
// buffer, which must outlive the build() call.
struct DecoderStep {
  enum Kind { Replace, ByteFallback, Fuse, Strip } kind;
  std::string pattern{}, content{};
  int start = 0, stop = 0;
};

struct BuildSpec {
  std::vector<std::string_view> vocab;  // model vocabulary by id (holes: empty + !present)
  std::vector<bool> present;
  std::vector<std::pair<std::string_view, std::string_view>> merges;  // rank order
  std::vector<std::pair<int32_t, float>> score_order;  // if merges empty: (id, score)
  std::vector<AddedToken> added;
  std::string unk_token;
  int32_t unk_id = -1;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  std::vector<NormStep> normalizer;
  bool has_split = false;
  std::string split_pattern;
  SplitBehavior split_behavior = SplitBehavior::Removed;
  bool has_decoder = false;
  std::vector<DecoderStep> decoder;
  int32_t bos = -1, eos = -1, pad = -1;
  bool post_adds_bos = false;
};

std::shared_ptr<const Impl> build(BuildSpec spec);

}  // namespace mb::tok_detail
