// Writes a model as GGUF in the layout llama.cpp's converter produces (its architecture's metadata
// keys, tensor names, value shifts and derived tensors: models/architecture.h), re-encoding the
// weights: what `markbase quantize` and `markbase bench --save` use.
#pragma once
#include <functional>
#include <string>

#include "models/checkpoint.h"

namespace mb {

enum class QuantType { Keep, F32, BF16, Q8_0, Q4_0, Q4_K_M };  // Keep: each tensor's own dtype
QuantType parse_quant_type(const std::string& s);  // f32 | bf16 | q8_0 | q4_0 | q4_k_m

// The dtype a tensor gets. Norms, scalars and other vectors stay F32. Q4_K_M follows llama.cpp's
// per-tensor mix: Q6_K for the (tied) embedding / output and for attn_v and ffn_down in the layers
// use_more_bits() picks, Q4_K elsewhere; a row length that is not a whole number of blocks falls
// back as llama.cpp does (Q4_K -> Q5_0, Q6_K -> Q8_0, Q8_0/Q4_0 -> the source's float type).
DType gguf_tensor_type(QuantType q, const std::string& gguf_name, const std::vector<int64_t>& shape, int n_layers,
                       DType source);

struct ExportProgress {
  size_t done = 0, total = 0;
  std::string tensor;
};

// `ck` may come from a checkpoint folder (its tokenizer.json / chat template are exported too) or
// from a GGUF (its metadata is copied, its tensors keep their file order). Either way the
// architecture's derived tensors are written from the config, and every tensor of a GGUF source
// is accounted for: one that would be dropped is an error. `tokenizer_json`, when given, is the tokenizer.json to
// export instead of the folder's (a synthetic checkpoint has no folder); it must exist. Tensors
// kept in their dtype are written straight from the checkpoint's memory, not copied first.
// Throws mb::Error on anything it cannot represent.
void export_gguf(const Checkpoint& ck, const std::string& out_path, QuantType q,
                 const std::function<void(const ExportProgress&)>& progress = nullptr,
                 const std::string& tokenizer_json = "");

}  // namespace mb
