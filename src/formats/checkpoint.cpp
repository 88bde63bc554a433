#include "formats/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "formats/gguf_model.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"

namespace mb {

namespace fs = std::filesystem;
using json = nlohmann::json;

static json read_json_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  MB_CHECK(in.good(), "cannot open {}", p.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", p.string(), e.what());
  }
}

static bool is_multimodal_tensor(const std::string& name) {
  for (const char* p : {"model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                        "model.embed_audio.", "vision_tower.", "audio_tower.", "multi_modal_projector.",
                        "model.multi_modal_projector."})
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

std::unique_ptr<Checkpoint> open_checkpoint(const std::string& path, const CheckpointOptions& opts) {
  auto ck = std::make_unique<Checkpoint>();
  ck->path = path;
  fs::path p(path);
  MB_CHECK(fs::exists(p), "model path {} does not exist", path);
  if (!fs::is_directory(p)) {
    if (p.extension() == ".gguf") {
      ck->gguf = load_gguf_model(path, ck->config, ck->tensors);
      return ck;
    }
    fail("{}: expected a checkpoint folder (config.json + *.safetensors) or a .gguf file", path);
  }
  MB_CHECK(fs::exists(p / "config.json"), "{}: no config.json in the checkpoint folder", path);
  json config = read_json_file(p / "config.json");
  json gen;
  bool have_gen = fs::exists(p / "generation_config.json");
  if (have_gen) gen = read_json_file(p / "generation_config.json");
  ck->config = parse_hf_config(config, (p / "config.json").string(), have_gen ? &gen : nullptr);

  auto keep = [&](const std::string& name) { return opts.load_multimodal || !is_multimodal_tensor(name); };
  if (fs::exists(p / "model.safetensors.index.json")) {
    json index = read_json_file(p / "model.safetensors.index.json");
    MB_CHECK(index.contains("weight_map") && index["weight_map"].is_object(),
             "{}: model.safetensors.index.json has no weight_map", path);
    std::set<std::string> shards;
    for (auto& [name, file] : index["weight_map"].items()) {
      MB_CHECK(file.is_string(), "{}: weight_map entry for '{}' is not a file name", path, name);
      std::string f = file.get<std::string>();
      MB_CHECK(f.find('/') == std::string::npos && f.find("..") == std::string::npos,
               "{}: weight_map names a file outside the checkpoint: {}", path, f);
      if (keep(name)) shards.insert(f);
    }
    for (auto& f : shards) {
      MB_CHECK(fs::exists(p / f), "{}: shard {} listed in model.safetensors.index.json is missing", path, f);
      load_safetensors((p / f).string(), ck->tensors, keep);
    }
  } else if (fs::exists(p / "model.safetensors")) {
    load_safetensors((p / "model.safetensors").string(), ck->tensors, keep);
  } else {
    fail("{}: no model.safetensors or model.safetensors.index.json in the checkpoint folder", path);
  }

  // The text decoder's tensors live under a prefix that depends on the class that saved them.
  for (const char* prefix : {"model.language_model.", "model.", "language_model.model.", ""}) {
    if (ck->tensors.contains(std::string(prefix) + "embed_tokens.weight")) {
      ck->config.tensor_prefix = prefix;
      return ck;
    }
  }
  fail("missing tensor 'embed_tokens.weight' (looked for model.language_model.embed_tokens.weight and "
       "model.embed_tokens.weight) in {}",
       ck->tensors.describe_sources());
}

}  // namespace mb
