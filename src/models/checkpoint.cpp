#include "models/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "formats/gguf.h"
#include "formats/safetensors.h"
#include "models/architecture.h"
#include "models/gguf_config.h"
#include "models/hf_config.h"

namespace mb {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

json read_json_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  MB_CHECK(in.good(), "cannot open {}", p.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", p.string(), e.what());
  }
}

// The error for a path that is neither a checkpoint folder nor a GGUF file, saying what it is.
[[noreturn]] void not_a_model(const fs::path& p) {
  const std::string name = p.filename().string();
  if (name == "config.json" || p.extension() == ".safetensors")
    fail("{}: give the checkpoint folder ({}), not a file inside it", p.string(), p.parent_path().string());
  fail("{}: not a GGUF file (it does not start with the bytes 'GGUF') and not a checkpoint folder "
       "(config.json + *.safetensors)",
       p.string());
}

}  // namespace

const Architecture& Checkpoint::architecture() const { return architecture_named(config.family); }

std::unique_ptr<Checkpoint> open_checkpoint(const std::string& path, const CheckpointOptions& opts) {
  auto ck = std::make_unique<Checkpoint>();
  ck->path = path;
  check_image_tokens(opts.image_tokens);
  ck->image_tokens = opts.image_tokens;
  ck->exact_media = opts.exact_media;
  fs::path p(path);
  MB_CHECK(fs::exists(p), "model path {} does not exist", path);
  if (!fs::is_directory(p)) {
    if (!is_gguf_file(path)) not_a_model(p);
    ck->gguf = load_gguf_model(path, ck->config, ck->tensors);
    if (opts.load_multimodal && !opts.mmproj.empty()) ck->architecture().attach_mmproj(*ck, opts.mmproj);
    return ck;
  }
  MB_CHECK(opts.mmproj.empty(), "--mmproj goes with a GGUF model: {} is a checkpoint folder, which holds its own "
           "vision/audio towers", path);
  MB_CHECK(fs::exists(p / "config.json"), "{}: no config.json in the checkpoint folder", path);
  json config = read_json_file(p / "config.json");
  json gen;
  bool have_gen = fs::exists(p / "generation_config.json");
  if (have_gen) gen = read_json_file(p / "generation_config.json");
  ck->config = parse_hf_config(config, (p / "config.json").string(), have_gen ? &gen : nullptr);
  ck->hf_config = config;
  const Architecture& arch = ck->architecture();

  auto keep = [&](const std::string& name) { return opts.load_multimodal || !arch.is_multimodal_tensor(name); };
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

void check_image_tokens(int n) {
  MB_CHECK(n == 0 || n == 70 || n == 140 || n == 280 || n == 560 || n == 1120,
           "image soft tokens must be one of 70, 140, 280, 560, 1120, got {}", n);
}

void check_mmproj(const Checkpoint& model, const std::string& mmproj) {
  MB_CHECK(model.gguf, "--mmproj goes with a GGUF model: {} is a checkpoint folder, which holds its own vision/audio "
           "towers", model.path);
  MB_CHECK(fs::exists(mmproj) && !fs::is_directory(mmproj), "mmproj file {} does not exist", mmproj);
  open_checkpoint(model.path, {.load_multimodal = true, .mmproj = mmproj});
}

const Architecture& model_architecture(const std::string& path) {
  fs::path p(path);
  MB_CHECK(fs::exists(p), "model path {} does not exist", path);
  if (fs::is_directory(p)) {
    MB_CHECK(fs::exists(p / "config.json"), "{}: no config.json in the checkpoint folder", path);
    return architecture_for_hf_config(read_json_file(p / "config.json"), (p / "config.json").string());
  }
  if (!is_gguf_file(path)) not_a_model(p);
  return architecture_for_gguf(*GgufFile::open(path));
}

}  // namespace mb
