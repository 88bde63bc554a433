#include "models/architecture.h"

#include <algorithm>
#include <array>

#include <fmt/ranges.h>

#include "core/error.h"
#include "core/printable.h"
#include "formats/gguf.h"
#include "models/checkpoint.h"
#include "models/hf_config.h"
#include "models/media_encoder.h"

namespace mb {

// One line per architecture folder.
const Architecture& gemma4_architecture();
const Architecture& gemma3_architecture();

std::span<const Architecture* const> architectures() {
  static const std::array<const Architecture*, 2> all = {&gemma4_architecture(), &gemma3_architecture()};
  return all;
}

const Architecture& architecture_named(std::string_view name) {
  for (const Architecture* a : architectures())
    if (a->name() == name) return *a;
  fail("no architecture named '{}'", name);
}

const Architecture& architecture_for_hf_config(const nlohmann::json& config, const std::string& source) {
  MB_CHECK(config.is_object(), "{}: expected a JSON object", source);
  const std::string hf_class = hf::class_of(config);
  const std::string model_type = hf::model_type_of(config);
  std::vector<std::string_view> supported;
  for (const Architecture* a : architectures()) {
    if (a->reads_hf_config(hf_class, model_type)) return *a;
    for (std::string_view c : a->hf_classes()) supported.push_back(c);
  }
  fail("{}: unknown architecture '{}' (model_type '{}'); supported: {}", source, hf_class, model_type,
       fmt::join(supported, ", "));
}

const Architecture& architecture_for_gguf(const GgufFile& f) {
  const GgufValue& a = f.get("general.architecture");
  MB_CHECK(a.type == GgufType::STRING, "{}: general.architecture should be a string, found {}", f.path(),
           a.describe());
  std::vector<std::string_view> supported;
  for (const Architecture* arch : architectures()) {
    if (arch->gguf_architecture() == a.str) return *arch;
    supported.push_back(arch->gguf_architecture());
  }
  fail("{}: unsupported GGUF architecture '{}' (supported: {})", f.path(), printable(a.str), fmt::join(supported, ", "));
}

bool split_layer(std::string_view s, std::string_view prefix, std::string_view& index, std::string_view& rest) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  const size_t dot = s.find('.', prefix.size());
  if (dot == std::string_view::npos || dot == prefix.size()) return false;
  index = s.substr(prefix.size(), dot - prefix.size());
  if (!std::all_of(index.begin(), index.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) return false;
  rest = s.substr(dot + 1);
  return true;
}

namespace {

constexpr std::string_view kGgufLayer = "blk.", kHfLayer = "model.layers.";

}  // namespace

std::unique_ptr<MediaEncoder> Architecture::make_media_encoder(std::shared_ptr<const Checkpoint> ck,
                                                               Backend& backend) const {
  fail("{}: {} models read text only (no image or audio input)", ck->path, name());
}

void Architecture::attach_mmproj(Checkpoint& ck, const std::string& path) const {
  fail("{}: {} models read no mmproj file ({})", ck.path, name(), path);
}

std::string Architecture::gguf_to_hf_name(const std::string& g) const {
  for (const std::string& d : gguf_derived_tensors())
    if (g == d) return "";
  for (auto [gg, hf] : gguf_global_names())
    if (g == gg) return std::string(hf);
  std::string_view index, rest;
  if (split_layer(g, kGgufLayer, index, rest))
    for (auto [gg, hf] : gguf_layer_names())
      if (rest == gg) return fmt::format("{}{}.{}", kHfLayer, index, hf);
  return g;
}

std::string Architecture::hf_to_gguf_name(const std::string& h) const {
  for (auto [gg, hf] : gguf_global_names())
    if (h == hf) return std::string(gg);
  std::string_view index, rest;
  if (split_layer(h, kHfLayer, index, rest))
    for (auto [gg, hf] : gguf_layer_names())
      if (rest == hf) return fmt::format("{}{}.{}", kGgufLayer, index, gg);
  return "";
}

}  // namespace mb
