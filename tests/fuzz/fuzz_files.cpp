// Fuzz target "files", the model-file parsers: every input goes to the GGUF reader (from memory,
// then to the gemma3/gemma4 config resolver and the tensor registry) and to the safetensors
// loader (through a memfd, since it takes a path). An mb::Error is the expected answer to bad
// bytes; anything else (a crash, a sanitizer report, another exception) is a finding.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "formats/gguf.h"
#include "models/architecture.h"
#include "models/gguf_config.h"
#include "formats/safetensors.h"
#include "fuzz_targets.h"

namespace mbfuzz {
namespace {

void gguf(const uint8_t* data, size_t size) {
  std::shared_ptr<mb::GgufFile> f;
  try {
    f = mb::GgufFile::parse(data, size, "fuzz.gguf");
  } catch (const mb::Error&) {
    return;
  }
  try {
    const mb::Architecture& arch = mb::architecture_for_gguf(*f);
    mb::TensorRegistry reg;
    f->register_tensors(reg, [&](const std::string& name) { return arch.gguf_to_hf_name(name); });
  } catch (const mb::Error&) {
  }
  try {
    mb::gguf_model_config(*f);
  } catch (const mb::Error&) {
  }
  for (auto& [k, v] : f->metadata()) (void)v.describe();
}

void safetensors(const uint8_t* data, size_t size) {
  static int fd = memfd_create("fuzz.safetensors", 0);
  if (fd < 0) std::abort();
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != ssize_t(size)) std::abort();
  try {
    mb::TensorRegistry reg;
    mb::load_safetensors("/proc/self/fd/" + std::to_string(fd), reg);
  } catch (const mb::Error&) {
  }
}

mb::GgufValue u32(uint64_t v) { return mb::GgufValue::make_uint(mb::GgufType::U32, v); }

}  // namespace

// Seeds that reach deep into the config resolver: small but complete gemma3 and gemma4 headers
// (tools/fuzz.sh adds tests/fixtures/gguf/all_types.gguf).
void write_file_seeds(const std::string& dir) {
  using mb::GgufValue;
  using mb::GgufType;
  for (std::string arch : {"gemma3", "gemma4"}) {
    mb::GgufWriter w;
    w.set("general.architecture", GgufValue::make_string(arch));
    w.set(arch + ".embedding_length", u32(8));
    w.set(arch + ".block_count", u32(2));
    w.set(arch + ".attention.head_count", u32(2));
    w.set(arch + ".attention.head_count_kv", GgufValue::make_int_array(GgufType::I32, {1, 1}));
    w.set(arch + ".feed_forward_length", GgufValue::make_int_array(GgufType::I32, {16, 32}));
    w.set(arch + ".attention.key_length", u32(4));
    w.set(arch + ".attention.sliding_window", u32(4));
    w.set(arch + ".rope.freq_base", GgufValue::make_float(GgufType::F32, 1e6));
    w.set(arch + ".attention.sliding_window_pattern", GgufValue::make_bool_array({true, false}));
    w.set(arch + ".attention.shared_kv_layers", u32(0));
    w.set("tokenizer.ggml.tokens", GgufValue::make_string_array({"<pad>", "<eos>", "<end_of_turn>", "<turn|>"}));
    float embd[4 * 8] = {}, freqs[2] = {1.f, 1e30f};
    w.add_tensor("token_embd.weight", mb::DType::F32, {4, 8}, embd);
    if (arch == "gemma4") w.add_tensor("rope_freqs.weight", mb::DType::F32, {2}, freqs);
    w.add_tensor("blk.0.attn_v.weight", mb::DType::Q8_0, {1, 32}, embd);
    write_file(dir + "/" + arch + ".gguf", w.bytes());
  }
  const std::string hdr = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]},"__metadata__":{"format":"pt"}})";
  std::string st(8, '\0');
  for (int i = 0; i < 8; ++i) st[size_t(i)] = char((hdr.size() >> (8 * i)) & 0xff);
  write_file(dir + "/tiny.safetensors", st + hdr + std::string(12, '\x3f'));
}

void fuzz_files(const uint8_t* data, size_t size) {
  gguf(data, size);
  safetensors(data, size);
}

}  // namespace mbfuzz
