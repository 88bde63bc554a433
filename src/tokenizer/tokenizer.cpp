#include "tokenizer/tokenizer.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/tokenizer_impl.h"

namespace mb {
namespace tok_detail {
namespace {

constexpr uint32_t kMaxCodepoint = 0x110000;

// First / last code point of a non-empty string. Vocabulary strings from a GGUF file may be
// ill-formed; those read as U+FFFD, which only makes the word cutting below more cautious.
uint32_t first_cp(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  int len;
  return utf8_check(p, s.size()) > 0 ? utf8_decode(p, &len) : 0xFFFD;
}

uint32_t last_cp(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && s.size() - i < 4 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return first_cp(s.substr(i));
}

bool is_single_cp(std::string_view s) {
  if (s.empty()) return false;
  int r = utf8_check(reinterpret_cast<const unsigned char*>(s.data()), s.size());
  return r > 0 && static_cast<size_t>(r) == s.size();
}

// Unicode White_Space, the `\s` of HF's lstrip/rstrip regexes.
bool is_space_cp(uint32_t c) {
  return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Rust's u8::from_str_radix(s, 16), which HF's ByteFallback decoder uses on "<0xHH>".
int parse_hex_byte(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') return hex(t[4]);
  int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty() || s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + s.size() / 4 * (to.size() > from.size() ? to.size() - from.size() : 0));
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  out.append(s, pos);
  s = std::move(out);
}

std::string apply_strip(std::string_view t, const DecodeStrip& st) {
  std::string_view c = st.content;
  for (int k = 0; k < st.start && !c.empty() && t.starts_with(c); ++k) t.remove_prefix(c.size());
  for (int k = 0; k < st.stop && !c.empty() && t.ends_with(c); ++k) t.remove_suffix(c.size());
  return std::string(t);
}

}  // namespace

void AddedTrie::build(const std::vector<AddedToken>& added, bool normalized_set,
                      const std::vector<std::string>& contents) {
  // Children are collected per node while building, then flattened into sorted edge arrays.
  struct BuildNode {
    std::vector<std::pair<uint8_t, uint32_t>> kids;
    int32_t token = -1;
  };
  std::vector<BuildNode> tmp(1);
  for (size_t k = 0; k < added.size(); ++k) {
    if (added[k].normalized != normalized_set || contents[k].empty()) continue;
    uint32_t node = 0;
    for (unsigned char b : contents[k]) {
      uint32_t next = 0;
      for (auto& [eb, child] : tmp[node].kids)
        if (eb == b) next = child;
      if (next == 0) {
        next = static_cast<uint32_t>(tmp.size());
        tmp[node].kids.emplace_back(b, next);
        tmp.emplace_back();
      }
      node = next;
    }
    if (tmp[node].token < 0) tmp[node].token = static_cast<int32_t>(k);  // first one wins
  }
  nodes.assign(tmp.size(), Node{});
  edges.clear();
  first_byte.fill(false);
  for (size_t i = 0; i < tmp.size(); ++i) {
    auto& kids = tmp[i].kids;
    std::sort(kids.begin(), kids.end());
    nodes[i].first_edge = static_cast<uint32_t>(edges.size());
    nodes[i].n_edges = static_cast<uint32_t>(kids.size());
    nodes[i].token = tmp[i].token;
    for (auto& [b, child] : kids) edges.push_back(Edge{b, child});
  }
  for (auto& [b, child] : tmp[0].kids) first_byte[b] = true;
}

size_t AddedTrie::longest(std::string_view s, int32_t* token) const {
  uint32_t node = 0;
  size_t best = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const Node& n = nodes[node];
    const uint8_t b = static_cast<uint8_t>(s[i]);
    uint32_t next = 0;
    for (uint32_t e = n.first_edge, end = n.first_edge + n.n_edges; e < end; ++e) {
      if (edges[e].byte == b) {
        next = edges[e].child;
        break;
      }
      if (edges[e].byte > b) break;
    }
    if (next == 0) break;
    node = next;
    if (nodes[node].token >= 0) {
      best = i + 1;
      *token = nodes[node].token;
    }
  }
  return best;
}

std::shared_ptr<const Impl> build(BuildSpec spec) {
  auto impl = std::make_shared<Impl>();
  Impl& m = *impl;

  // Ids: the model vocabulary, extended by added tokens that live beyond it (Gemma 3's
  // <image_soft_token> is id 262144 with a 262144-entry model vocabulary).
  int32_t n = static_cast<int32_t>(spec.vocab.size());
  m.n_model = n;
  for (const AddedToken& a : spec.added) {
    MB_CHECK(a.id >= 0, "tokenizer: added token '{}' has a negative id", a.content);
    n = std::max(n, a.id + 1);
  }
  std::vector<int32_t> added_at(n, -1);
  for (size_t k = 0; k < spec.added.size(); ++k) added_at[spec.added[k].id] = static_cast<int32_t>(k);

  // Normalized added tokens match, and read back (HF's id_to_token), in normalized form.
  std::vector<std::string> contents;
  for (const AddedToken& a : spec.added) {
    std::string c = a.content;
    if (a.normalized) {
      for (const NormStep& st : spec.normalizer) {
        if (st.kind == NormStep::Replace) replace_all(c, st.pattern, st.content);
        else if (!c.empty()) c.insert(0, st.content);
      }
    }
    contents.push_back(std::move(c));
  }

  m.flags.assign(n, 0);
  m.pieces.assign(n, Impl::Span{0, 0});
  size_t total = 0;
  for (int32_t id = 0; id < m.n_model; ++id) total += spec.vocab[id].size();
  for (size_t k = 0; k < spec.added.size(); ++k) total += spec.added[k].content.size() + contents[k].size();
  m.pool.reserve(total);
  for (int32_t id = 0; id < m.n_model; ++id) {
    if (!spec.present[id]) continue;
    m.pieces[id] = Impl::Span{static_cast<uint32_t>(m.pool.size()), static_cast<uint32_t>(spec.vocab[id].size())};
    m.pool += spec.vocab[id];
    m.flags[id] = Impl::kValid;
  }
  // The BPE model and HF's token_to_id fallback see the model strings.
  const char* base = m.pool.data();
  m.model_index.reserve(m.n_model);
  {
    std::vector<uint64_t> hashes(m.n_model);
    for (int32_t id = 0; id < m.n_model; ++id) hashes[id] = hash_bytes(m.piece(id));
    for (int32_t id = 0; id < m.n_model; ++id) {
      if (id + 16 < m.n_model) m.model_index.prefetch_slot(hashes[id + 16]);
      if (m.flags[id]) m.model_index.insert(m.piece(id), hashes[id], m.pieces[id].off, id, base);
    }
  }
  auto model_find = [&](std::string_view s) { return m.model_index.find(s, base); };
  // HF's id_to_token asks the added vocabulary first; its token_to_id takes the raw content.
  // (The pool was reserved for everything appended here, so `base` stays valid.)
  auto append = [&](std::string_view t) {
    Impl::Span sp{static_cast<uint32_t>(m.pool.size()), static_cast<uint32_t>(t.size())};
    m.pool += t;
    return sp;
  };
  m.added_index.reserve(spec.added.size());
  for (size_t k = 0; k < spec.added.size(); ++k) {
    const AddedToken& a = spec.added[k];
    if (a.id >= m.n_model || !m.flags[a.id] || m.piece(a.id) != contents[k]) m.pieces[a.id] = append(contents[k]);
    m.flags[a.id] = Impl::kValid | Impl::kAdded | (a.special ? Impl::kSpecial : 0);
    uint32_t off = m.piece(a.id) == a.content ? m.pieces[a.id].off : append(a.content).off;
    m.added_index.insert(a.content, off, a.id, base);
  }

  m.byte_fallback = spec.byte_fallback;
  m.fuse_unk = spec.fuse_unk;
  m.ignore_merges = spec.ignore_merges;
  m.unk = spec.unk_id >= 0 ? spec.unk_id : (spec.unk_token.empty() ? -1 : model_find(spec.unk_token));

  m.char_id.assign(kMaxCodepoint, -1);
  for (int32_t id = 0; id < m.n_model; ++id)
    if (spec.present[id] && is_single_cp(spec.vocab[id])) m.char_id[first_cp(spec.vocab[id])] = id;
  bool all_bytes = true;
  for (int b = 0; b < 256; ++b) {
    m.byte_id[b] = model_find(fmt::format("<0x{:02X}>", b));
    all_bytes = all_bytes && m.byte_id[b] >= 0;
  }

  // Merges: rank order from the file, or (SentencePiece-style) from scores, where every split
  // of a piece shares the piece's rank so that equal ranks fall back to the leftmost pair.
  struct MergeRec {
    uint64_t key;  // left << 32 | right
    uint64_t val;  // rank << 32 | merged
    uint32_t left_last_cp, right_first_cp;
  };
  std::vector<MergeRec> pairs;
  if (!spec.merges.empty()) {
    // Three hash lookups per merge would be mostly cache misses; batches with two prefetch
    // stages (slot, then key bytes) overlap them.
    constexpr size_t kBatch = 64;
    pairs.reserve(spec.merges.size());
    std::string cat;
    std::array<uint64_t, kBatch * 3> h;
    std::array<uint32_t, kBatch + 1> cat_off;
    for (size_t r0 = 0; r0 < spec.merges.size(); r0 += kBatch) {
      const size_t nb = std::min(kBatch, spec.merges.size() - r0);
      cat.clear();
      for (size_t k = 0; k < nb; ++k) {
        auto [a, b] = spec.merges[r0 + k];
        if (a.empty() || b.empty()) fail("tokenizer: merge {} has an empty part", r0 + k);
        cat_off[k] = static_cast<uint32_t>(cat.size());
        cat.append(a).append(b);
        h[3 * k] = hash_bytes(a);
        h[3 * k + 1] = hash_bytes(b);
        h[3 * k + 2] = hash_bytes(std::string_view(cat).substr(cat_off[k]));
      }
      cat_off[nb] = static_cast<uint32_t>(cat.size());
      for (size_t k = 0; k < 3 * nb; ++k) m.model_index.prefetch_slot(h[k]);
      for (size_t k = 0; k < 3 * nb; ++k) m.model_index.prefetch_key(h[k], base);
      for (size_t k = 0; k < nb; ++k) {
        auto [a, b] = spec.merges[r0 + k];
        std::string_view ab = std::string_view(cat).substr(cat_off[k], cat_off[k + 1] - cat_off[k]);
        int32_t ia = m.model_index.find(a, h[3 * k], base), ib = m.model_index.find(b, h[3 * k + 1], base);
        int32_t iab = m.model_index.find(ab, h[3 * k + 2], base);
        if (ia < 0 || ib < 0 || iab < 0)
          fail("tokenizer: merge {} ('{}' '{}') uses a piece missing from the vocabulary", r0 + k, a, b);
        pairs.push_back(MergeRec{uint64_t(ia) << 32 | uint32_t(ib), uint64_t(r0 + k) << 32 | uint32_t(iab),
                                 last_cp(a), first_cp(b)});
      }
    }
  } else if (!spec.score_order.empty()) {
    auto order = spec.score_order;
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& x, const auto& y) { return x.second > y.second; });
    uint64_t rank = 0;
    for (size_t k = 0; k < order.size(); ++k) {
      if (k > 0 && order[k].second != order[k - 1].second) ++rank;
      int32_t id = order[k].first;
      if (id < 0 || id >= m.n_model || !spec.present[id] || added_at[id] >= 0) continue;
      std::string_view t = spec.vocab[id];
      if (parse_hex_byte(t) >= 0) continue;
      for (size_t cut = 1; cut < t.size(); ++cut) {
        if ((static_cast<unsigned char>(t[cut]) & 0xC0) == 0x80) continue;
        std::string_view a = t.substr(0, cut), b = t.substr(cut);
        int32_t ia = model_find(a), ib = model_find(b);
        if (ia >= 0 && ib >= 0)
          pairs.push_back(MergeRec{uint64_t(ia) << 32 | uint32_t(ib), rank << 32 | uint32_t(id), last_cp(a),
                                   first_cp(b)});
      }
    }
  }
  m.merges.reserve(pairs.size());
  for (size_t k = 0; k < pairs.size(); ++k) {
    if (k + 16 < pairs.size()) m.merges.prefetch(pairs[k + 16].key);
    m.merges.assign(pairs[k].key, pairs[k].val);  // HF's HashMap: the last one wins
  }

  // A word may be cut between code points p and c without changing the BPE result when no
  // merge has a left part ending in p and a right part starting with c: then no merge can
  // ever join symbols across the cut, the two sides evolve independently, and the rank/leftmost
  // order inside each side is the same as in the whole. Cut pieces are then cacheable.
  // Byte symbols and <unk> fusing would break that argument, so those setups do not cut.
  bool byte_merges = false;
  std::vector<uint8_t> is_byte_id(n, 0);
  for (int b = 0; b < 256; ++b)
    if (m.byte_id[b] >= 0) is_byte_id[m.byte_id[b]] = 1;
  m.cp_flags.assign(kMaxCodepoint, 0);
  std::vector<uint16_t> partners(kMaxCodepoint, 0);
  m.cross.reserve(1 << 15);
  for (const MergeRec& p : pairs) {
    if (is_byte_id[p.key >> 32] || is_byte_id[uint32_t(p.key)]) byte_merges = true;
    const uint32_t l = p.left_last_cp, r = p.right_first_cp;
    m.cp_flags[l] |= Impl::kEndsLeft;
    m.cp_flags[r] |= Impl::kStartsRight;
    if (m.cross.insert(uint64_t(l) << 21 | r, 0) && partners[r] < 0xFFFF) ++partners[r];
  }
  // Cut candidates: code points that follow few distinct characters in merges (U+2581 follows
  // only itself and '>' in Gemma), so testing before them usually finds a word boundary.
  for (uint32_t c = 0; c < kMaxCodepoint; ++c)
    if (partners[c] <= 4) m.cp_flags[c] |= Impl::kCut;
  m.chunking = m.byte_fallback && all_bytes && !byte_merges;

  // Added tokens.
  m.added = std::move(spec.added);  // ids and flags were set with the vocabulary
  m.normalizer = std::move(spec.normalizer);
  m.raw_trie.build(m.added, false, contents);
  m.norm_trie.build(m.added, true, contents);

  m.has_split = spec.has_split;
  m.split_pattern = std::move(spec.split_pattern);
  m.split_behavior = spec.split_behavior;

  // Decoder: steps before Fuse act on each token and are folded into a per-id string; after
  // Fuse only a Strip of the leading characters is supported (it is all that streams).
  m.has_decoder = spec.has_decoder;
  if (m.has_decoder) {
    std::vector<const DecoderStep*> per_token;
    bool fused = false;
    for (const DecoderStep& st : spec.decoder) {
      if (st.kind == DecoderStep::Fuse) {
        fused = true;
      } else if (st.kind == DecoderStep::ByteFallback) {
        MB_CHECK(!fused, "tokenizer: decoder ByteFallback after Fuse is not supported");
        m.dec_byte_fallback = true;
      } else if (fused) {
        MB_CHECK(st.kind == DecoderStep::Strip && st.stop == 0 && m.final_strip.start == 0,
                 "tokenizer: after Fuse the decoder supports one Strip of leading characters only");
        m.final_strip = DecodeStrip{st.content, st.start, st.stop};
      } else {
        MB_CHECK(!m.dec_byte_fallback,
                 "tokenizer: decoder Replace/Strip between ByteFallback and Fuse is not supported");
        per_token.push_back(&st);
      }
    }
    m.dec_off.assign(n + 1, 0);
    m.dec_byte.assign(n, -1);
    m.dec_pool.reserve(m.pool.size());
    std::string t;
    for (int32_t id = 0; id < n; ++id) {
      m.dec_off[id] = static_cast<uint32_t>(m.dec_pool.size());
      t.assign(m.piece(id));
      for (const DecoderStep* st : per_token) {
        if (st->kind == DecoderStep::Replace) replace_all(t, st->pattern, st->content);
        else t = apply_strip(t, DecodeStrip{st->content, st->start, st->stop});
      }
      if (m.dec_byte_fallback) m.dec_byte[id] = static_cast<int16_t>(parse_hex_byte(t));
      m.dec_pool += t;
    }
    m.dec_off[n] = static_cast<uint32_t>(m.dec_pool.size());
  }

  auto find_any = [&](std::initializer_list<std::string_view> names) {
    for (std::string_view s : names) {
      int32_t id = m.added_index.find(s, base);
      if (id < 0) id = model_find(s);
      if (id >= 0) return id;
    }
    return int32_t{-1};
  };
  m.bos = spec.bos >= 0 ? spec.bos : find_any({"<bos>", "<s>"});
  m.eos = spec.eos >= 0 ? spec.eos : find_any({"<eos>", "</s>"});
  m.pad = spec.pad >= 0 ? spec.pad : find_any({"<pad>"});
  m.post_adds_bos = spec.post_adds_bos;
  return impl;
}

namespace {

// Per-call memo of BPE results for short pieces; per call so that encode() stays const and
// thread-safe without locks.
class PieceCache {
 public:
  static constexpr size_t kMaxKey = 64;
  static constexpr size_t kMaxEntries = 1 << 20;

  std::span<const int32_t> find(std::string_view key, uint64_t h) const {
    if (slots_.empty()) return {};
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key_len == 0) return {};
      if (s.hash == h && key == std::string_view(keys_).substr(s.key_off, s.key_len))
        return {ids_.data() + s.ids_off, s.ids_len};
    }
  }
  void insert(std::string_view key, uint64_t h, std::span<const int32_t> ids) {
    if (size_ >= kMaxEntries) return;
    if ((size_ + 1) * 2 > slots_.size()) grow();
    size_t i = h & mask_;
    while (slots_[i].key_len != 0) i = (i + 1) & mask_;
    slots_[i] = Slot{h, uint32_t(keys_.size()), uint32_t(key.size()), uint32_t(ids_.size()),
                     uint32_t(ids.size())};
    keys_.append(key);
    ids_.insert(ids_.end(), ids.begin(), ids.end());
    ++size_;
  }

 private:
  struct Slot {
    uint64_t hash;
    uint32_t key_off, key_len, ids_off, ids_len;
  };
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    size_t cap = old.empty() ? 1024 : old.size() * 2;
    slots_.assign(cap, Slot{0, 0, 0, 0, 0});
    mask_ = cap - 1;
    for (const Slot& s : old) {
      if (s.key_len == 0) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].key_len != 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
  std::string keys_;
  std::vector<int32_t> ids_;
};

class Encoder {
 public:
  Encoder(const Impl& m, bool parse_special, std::vector<int32_t>& out)
      : m_(m), parse_special_(parse_special), out_(out) {}

  void raw_text(std::string_view s) {
    if (m_.raw_trie.empty()) return segment(s);
    split_added(m_.raw_trie, s, [&](std::string_view t) { segment(t); });
  }

 private:
  struct Sym {
    int32_t id, prev, next;
  };
  struct Cand {
    uint64_t key;  // rank << 32 | position, smallest first
    int32_t merged;
    bool operator>(const Cand& o) const { return key > o.key; }
  };
  static constexpr int kMaxRun = 64;  // code points before every boundary is tested for a cut

  // HF AddedVocabulary::find_matches: leftmost-longest, non-overlapping; a skipped match
  // (special while not parsing specials, or single_word not standing alone) is plain text.
  template <class OnText>
  void split_added(const AddedTrie& trie, std::string_view s, const OnText& on_text) {
    size_t pos = 0, start_offset = 0;
    while (pos < s.size()) {
      if (!trie.first_byte[static_cast<uint8_t>(s[pos])]) {
        ++pos;
        continue;
      }
      int32_t k = -1;
      size_t len = trie.longest(s.substr(pos), &k);
      if (len == 0) {
        ++pos;
        continue;
      }
      size_t start = pos, stop = pos + len;
      pos = stop;
      const AddedToken& a = m_.added[k];
      if (a.special && !parse_special_) continue;
      if (a.single_word) {
        bool left_ok = start == 0 || !is_word_char(last_cp(s.substr(0, start)));
        bool right_ok = stop == s.size() || !is_word_char(first_cp(s.substr(stop)));
        if (!left_ok || !right_ok) continue;
      }
      if (a.lstrip) {
        size_t b = start;
        while (b > 0) {
          size_t c = b - 1;
          while (c > 0 && (static_cast<unsigned char>(s[c]) & 0xC0) == 0x80) --c;
          if (!is_space_cp(first_cp(s.substr(c)))) break;
          b = c;
        }
        start = std::max(b, start_offset);
      }
      if (a.rstrip) {
        while (stop < s.size()) {
          int l;
          uint32_t c = utf8_decode(reinterpret_cast<const unsigned char*>(s.data()) + stop, &l);
          if (!is_space_cp(c)) break;
          stop += l;
        }
      }
      if (start_offset < start) on_text(s.substr(start_offset, start - start_offset));
      out_.push_back(a.id);
      start_offset = stop;
    }
    if (start_offset < s.size()) on_text(s.substr(start_offset));
  }

  void segment(std::string_view s) {
    std::string_view t = s;
    if (!m_.normalizer.empty()) {
      norm_.assign(s);
      for (const NormStep& st : m_.normalizer) {
        if (st.kind == NormStep::Replace) replace_all(norm_, st.pattern, st.content);
        else if (!norm_.empty()) norm_.insert(0, st.content);
      }
      t = norm_;
    }
    if (m_.norm_trie.empty()) return pre_tokenize(t);
    split_added(m_.norm_trie, t, [&](std::string_view u) { pre_tokenize(u); });
  }

  // HF Split pre-tokenizer with a literal pattern and its delimiter behaviours.
  void pre_tokenize(std::string_view s) {
    if (!m_.has_split || m_.split_pattern.empty()) return word(s);
    struct Piece {
      size_t b, e;
      bool match;
    };
    std::vector<Piece> raw;
    const std::string& pat = m_.split_pattern;
    size_t pos = 0;
    for (size_t hit; (hit = s.find(pat, pos)) != std::string_view::npos; pos = hit + pat.size()) {
      if (hit > pos) raw.push_back({pos, hit, false});
      raw.push_back({hit, hit + pat.size(), true});
    }
    if (pos < s.size()) raw.push_back({pos, s.size(), false});
    std::vector<Piece> out;
    bool prev_match = false;
    switch (m_.split_behavior) {
      case SplitBehavior::Removed:
        for (auto& p : raw)
          if (!p.match) out.push_back(p);
        break;
      case SplitBehavior::Isolated:
        out = raw;
        break;
      case SplitBehavior::MergedWithPrevious:
        for (auto& p : raw) {
          if (p.match && !prev_match && !out.empty()) out.back().e = p.e;
          else out.push_back(p);
          prev_match = p.match;
        }
        break;
      case SplitBehavior::MergedWithNext:
        for (auto it = raw.rbegin(); it != raw.rend(); ++it) {
          if (it->match && !prev_match && !out.empty()) out.back().b = it->b;
          else out.push_back(*it);
          prev_match = it->match;
        }
        std::reverse(out.begin(), out.end());
        break;
      case SplitBehavior::Contiguous:
        for (auto& p : raw) {
          if (p.match == prev_match && !out.empty()) out.back().e = p.e;
          else out.push_back(p);
          prev_match = p.match;
        }
        break;
    }
    for (auto& p : out) word(s.substr(p.b, p.e - p.b));
  }

  void word(std::string_view w) {
    if (w.empty()) return;
    if (m_.ignore_merges) {
      int32_t id = m_.model_index.find(w, m_.pool.data());
      if (id >= 0) {
        out_.push_back(id);
        return;
      }
    }
    if (!m_.chunking) return bpe(w);
    const auto* p = reinterpret_cast<const unsigned char*>(w.data());
    const uint8_t* flags = m_.cp_flags.data();
    size_t start = 0, i = 0;
    uint32_t prev = 0;
    uint8_t prev_flags = 0;
    int run = 0;
    while (i < w.size()) {
      int len = 1;
      uint32_t cp = p[i] < 0x80 ? p[i] : utf8_decode(p + i, &len);
      uint8_t f = flags[cp];
      if (i > start) {
        bool cut;
        if (!(prev_flags & Impl::kEndsLeft) || !(f & Impl::kStartsRight)) cut = true;
        else if ((f & Impl::kCut) || run >= kMaxRun) cut = !m_.cross.find(uint64_t(prev) << 21 | cp);
        else cut = false;
        if (cut) {
          piece(w.substr(start, i - start));
          start = i;
          run = 0;
        }
      }
      prev = cp;
      prev_flags = f;
      ++run;
      i += len;
    }
    piece(w.substr(start));
  }

  void piece(std::string_view s) {
    if (s.size() > PieceCache::kMaxKey) return bpe(s);
    uint64_t h = hash_bytes(s);
    auto hit = cache_.find(s, h);
    if (!hit.empty()) {
      out_.insert(out_.end(), hit.begin(), hit.end());
      return;
    }
    size_t before = out_.size();
    bpe(s);
    cache_.insert(s, h, std::span<const int32_t>(out_.data() + before, out_.size() - before));
  }

  // HF BPE::merge_word + Word::merge_all: symbols per character (or per byte via <0xXX>),
  // then repeatedly the lowest-rank adjacent pair, leftmost first, via a min-heap with lazy
  // deletion; a stale entry is recognised exactly as HF does (the pair no longer maps to the
  // entry's merged id).
  void bpe(std::string_view w) {
    syms_.clear();
    const auto* p = reinterpret_cast<const unsigned char*>(w.data());
    int32_t unk_len = 0;
    auto add = [&](int32_t id) {
      int32_t k = static_cast<int32_t>(syms_.size());
      syms_.push_back(Sym{id, k - 1, -1});
      if (k > 0) syms_[k - 1].next = k;
    };
    auto flush_unk = [&] {
      if (unk_len > 0) add(m_.unk);
      unk_len = 0;
    };
    for (size_t i = 0; i < w.size();) {
      int len = 1;
      uint32_t cp = p[i] < 0x80 ? p[i] : utf8_decode(p + i, &len);
      int32_t id = m_.char_id[cp];
      if (id >= 0) {
        flush_unk();
        add(id);
      } else if (m_.byte_fallback &&
                 std::all_of(p + i, p + i + len, [&](unsigned char b) { return m_.byte_id[b] >= 0; })) {
        flush_unk();
        for (int k = 0; k < len; ++k) add(m_.byte_id[p[i + k]]);
      } else if (m_.unk >= 0) {
        if (!m_.fuse_unk) flush_unk();
        unk_len += len;
      }
      i += len;
    }
    flush_unk();
    const size_t n = syms_.size();
    if (n >= 2) merge_all();
    for (int32_t k = n ? 0 : -1; k >= 0; k = syms_[k].next) out_.push_back(syms_[k].id);
  }

  void merge_all() {
    heap_.clear();
    const size_t n = syms_.size();
    for (size_t k = 0; k + 1 < n; ++k)
      if (const uint64_t* v = m_.merges.find(pair_key(syms_[k].id, syms_[k + 1].id)))
        heap_.push_back(Cand{(*v >> 32) << 32 | k, int32_t(uint32_t(*v))});
    std::make_heap(heap_.begin(), heap_.end(), std::greater<>());
    auto push = [&](uint64_t v, int32_t pos) {
      heap_.push_back(Cand{(v >> 32) << 32 | uint32_t(pos), int32_t(uint32_t(v))});
      std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
    };
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
      const Cand top = heap_.back();
      heap_.pop_back();
      const int32_t pos = int32_t(uint32_t(top.key));
      Sym& s = syms_[pos];
      if (s.id < 0 || s.next < 0) continue;
      Sym& r = syms_[s.next];
      const uint64_t* v = m_.merges.find(pair_key(s.id, r.id));
      if (!v || int32_t(uint32_t(*v)) != top.merged) continue;
      s.id = top.merged;
      r.id = -1;
      s.next = r.next;
      if (s.next >= 0) syms_[s.next].prev = pos;
      if (s.prev >= 0)
        if (const uint64_t* pv = m_.merges.find(pair_key(syms_[s.prev].id, s.id))) push(*pv, s.prev);
      if (s.next >= 0)
        if (const uint64_t* nv = m_.merges.find(pair_key(s.id, syms_[s.next].id))) push(*nv, pos);
    }
  }

  static uint64_t pair_key(int32_t a, int32_t b) { return uint64_t(uint32_t(a)) << 32 | uint32_t(b); }

  const Impl& m_;
  bool parse_special_;
  std::vector<int32_t>& out_;
  std::string norm_;
  std::vector<Sym> syms_;
  std::vector<Cand> heap_;
  PieceCache cache_;
};

// CPython's bytes.decode("utf-8", "replace").
std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 16);
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    int r = p[i] < 0x80 ? 1 : utf8_check(p + i, n - i);
    if (r > 0) {
      out.append(s.data() + i, r);
      i += r;
      continue;
    }
    out.append(kReplacementChar);
    if (r == 0) {  // truncated at the end: the rest is one maximal subpart
      break;
    }
    i += -r;
  }
  return out;
}

// HF ByteFallback: a run of byte tokens that is not valid UTF-8 as a whole becomes one U+FFFD
// per byte.
void close_byte_run(std::string& out, size_t run_start) {
  std::string_view run = std::string_view(out).substr(run_start);
  if (utf8_valid(run)) return;
  size_t n = run.size();
  out.resize(run_start);
  for (size_t k = 0; k < n; ++k) out.append(kReplacementChar);
}

}  // namespace
}  // namespace tok_detail

using tok_detail::Impl;

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::string fixed;
  if (!utf8_valid(text)) {
    fixed = tok_detail::sanitize_utf8(text);
    text = fixed;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  tok_detail::Encoder(*impl_, parse_special, out).raw_text(text);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& m = *impl_;
  std::string out;
  if (!m.has_decoder) {  // HF joins the raw tokens with spaces
    bool first = true;
    for (int32_t id : ids) {
      if (!m.valid(id) || (skip_special && (m.flags[id] & Impl::kSpecial))) continue;
      if (!first) out += ' ';
      out.append(m.piece(id));
      first = false;
    }
    return out;
  }
  out.reserve(ids.size() * 6);
  size_t run_start = std::string::npos;
  for (int32_t id : ids) {
    if (!m.valid(id) || (skip_special && (m.flags[id] & Impl::kSpecial))) continue;
    if (int b = m.dec_byte[id]; b >= 0) {
      if (run_start == std::string::npos) run_start = out.size();
      out += static_cast<char>(b);
      continue;
    }
    if (run_start != std::string::npos) {
      tok_detail::close_byte_run(out, run_start);
      run_start = std::string::npos;
    }
    out.append(m.dec_text(id));
  }
  if (run_start != std::string::npos) tok_detail::close_byte_run(out, run_start);
  if (m.final_strip.start > 0) out = tok_detail::apply_strip(out, m.final_strip);
  return out;
}

std::string_view Tokenizer::token_text(int32_t id) const {
  return impl_->valid(id) ? impl_->piece(id) : std::string_view();
}

int32_t Tokenizer::find_token(std::string_view piece) const {
  const Impl& m = *impl_;
  int32_t id = m.added_index.find(piece, m.pool.data());
  return id >= 0 ? id : m.model_index.find(piece, m.pool.data());
}

int32_t Tokenizer::vocab_size() const { return impl_->size(); }
int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }
int32_t Tokenizer::unk_id() const { return impl_->unk; }
bool Tokenizer::is_special(int32_t id) const {
  return impl_->valid(id) && (impl_->flags[id] & Impl::kSpecial);
}
bool Tokenizer::is_added(int32_t id) const {
  return impl_->valid(id) && (impl_->flags[id] & Impl::kAdded);
}
bool Tokenizer::is_byte(int32_t id) const {
  return impl_->valid(id) && impl_->has_decoder && impl_->dec_byte[id] >= 0;
}
bool Tokenizer::post_processor_adds_bos() const { return impl_->post_adds_bos; }

Tokenizer Tokenizer::from_vocab(std::vector<std::string> tokens, std::vector<std::string> merges,
                                std::vector<int32_t> token_types, const VocabOptions& options) {
  using namespace tok_detail;
  MB_CHECK(!tokens.empty(), "tokenizer: empty token list");
  MB_CHECK(token_types.empty() || token_types.size() == tokens.size(),
           "tokenizer: {} token types for {} tokens", token_types.size(), tokens.size());
  BuildSpec spec;
  spec.vocab.assign(tokens.begin(), tokens.end());
  spec.present.assign(tokens.size(), true);
  for (size_t id = 0; id < token_types.size(); ++id) {
    auto type = static_cast<TokenType>(token_types[id]);
    bool special = type == TokenType::Control || type == TokenType::Unknown;
    if (special || type == TokenType::UserDefined || type == TokenType::Unused)
      spec.added.push_back(AddedToken{int32_t(id), tokens[id], special});
  }
  spec.merges.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    std::string_view mg = merges[r];
    size_t sp = mg.size() > 1 ? mg.find(' ', 1) : std::string_view::npos;
    MB_CHECK(sp != std::string_view::npos, "tokenizer: merge {} ('{}') has no space", r, mg);
    spec.merges.emplace_back(mg.substr(0, sp), mg.substr(sp + 1));
  }
  if (merges.empty()) {
    MB_CHECK(options.scores.size() == tokens.size(),
             "tokenizer: no merges and {} scores for {} tokens", options.scores.size(), tokens.size());
    for (size_t id = 0; id < tokens.size(); ++id) spec.score_order.emplace_back(int32_t(id), options.scores[id]);
  }
  spec.unk_id = options.unk_id;
  if (spec.unk_id < 0) spec.unk_token = "<unk>";
  spec.byte_fallback = options.byte_fallback;
  spec.fuse_unk = true;
  if (!options.space_replacement.empty())
    spec.normalizer.push_back(NormStep{NormStep::Replace, " ", options.space_replacement});
  spec.has_decoder = true;
  if (!options.space_replacement.empty())
    spec.decoder.push_back(DecoderStep{DecoderStep::Replace, options.space_replacement, " "});
  if (options.byte_fallback) spec.decoder.push_back(DecoderStep{DecoderStep::ByteFallback});
  spec.decoder.push_back(DecoderStep{DecoderStep::Fuse});
  spec.bos = options.bos_id;
  spec.eos = options.eos_id;
  spec.pad = options.pad_id;
  return Tokenizer(build(std::move(spec)));
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special)
    : impl_(tokenizer.impl_), skip_special_(skip_special), strip_left_(impl_->final_strip.start) {}

std::string StreamingDecoder::push(int32_t id) {
  const Impl& m = *impl_;
  std::string out;
  if (!m.valid(id) || (skip_special_ && (m.flags[id] & Impl::kSpecial))) return out;
  if (!m.has_decoder) {
    if (!at_start_) out += ' ';
    at_start_ = false;
    out.append(m.piece(id));
    return out;
  }
  if (int b = m.dec_byte[id]; b >= 0) {
    pending_ += static_cast<char>(b);
    drain(out, false);
    return out;
  }
  drain(out, true);
  std::string_view t = m.dec_text(id);
  const tok_detail::DecodeStrip& st = m.final_strip;
  while (at_start_ && strip_left_ > 0 && !t.empty() && t.starts_with(st.content)) {
    t.remove_prefix(st.content.size());
    --strip_left_;
  }
  if (!t.empty()) at_start_ = false;
  out.append(t);
  return out;
}

// Emits the whole characters at the front of pending_; an ill-formed byte becomes U+FFFD at
// once, an unfinished character waits unless `final`.
void StreamingDecoder::drain(std::string& out, bool final) {
  const auto* p = reinterpret_cast<const unsigned char*>(pending_.data());
  const size_t n = pending_.size();
  const tok_detail::DecodeStrip& st = impl_->final_strip;
  size_t i = 0;
  while (i < n) {
    int r = utf8_check(p + i, n - i);
    if (r == 0 && !final) break;
    std::string_view ch = r > 0 ? std::string_view(pending_).substr(i, r) : tok_detail::kReplacementChar;
    i += r > 0 ? r : 1;
    if (at_start_ && strip_left_ > 0 && ch == st.content) {
      --strip_left_;
      continue;
    }
    at_start_ = false;
    out.append(ch);
  }
  pending_.erase(0, i);
}

std::string StreamingDecoder::flush() {
  std::string out;
  if (impl_->has_decoder) drain(out, true);
  pending_.clear();
  at_start_ = true;
  strip_left_ = impl_->final_strip.start;
  return out;
}

}  // namespace mb
