// Media in prompts: each image, audio clip or video is encoded once (soft tokens kept by content hash,
// so a later turn about the same image does not encode it again) and placed at its placeholder run(s),
// each of which becomes a MediaSpan of the request (a video: one per frame). The prefix cache keys
// those positions by the hash.
#pragma once
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "media/file.h"
#include "models/checkpoint.h"
#include "models/media_encoder.h"
#include "runtime/request.h"

namespace mb {

class PromptMedia {
 public:
  // The model's media front-ends over the checkpoint at `model_path`, opened again with its
  // vision/audio tensors when the first media item comes (text-only use never maps them); a GGUF
  // model's from opts.mmproj (llama.cpp's mmproj GGUF).
  PromptMedia(std::string model_path, CheckpointOptions opts, Backend& backend);
  ~PromptMedia();

  // Text to token ids (no BOS): a video's frame timestamps are text in the prompt.
  using Tokenize = std::function<std::vector<int32_t>(const std::string&)>;

  // Places `items` in `prompt` and returns their spans. The k-th image fills the k-th run of image
  // placeholders (likewise audio): a run of exactly its soft-token count as it is, a single
  // placeholder (what chat templates print) expanded to begin marker + placeholders + end marker
  // (the markers kept where the prompt already has them). A video's single placeholder becomes what
  // Gemma4Processor writes for it: per frame `MM:SS ` + begin + placeholders + end, frames joined by a
  // space (the timestamps through `tokenize`); a video already written out that way fills its frame
  // runs in order. A prompt with no placeholders of a kind gets its items right after a leading BOS.
  // Throws for counts that do not match. `rendered`: the prompt is a chat template's rendering, where
  // each placeholder stands for one item (adjacent items make a run of several), so every one is expanded.
  std::vector<MediaSpan> place(std::vector<int32_t>& prompt, const std::vector<MediaItem>& items, int32_t bos_id,
                               bool rendered = false, const Tokenize& tokenize = nullptr);

 private:
  struct Block {
    std::shared_ptr<const std::vector<float>> soft;  // [tokens, hidden]
    int64_t tokens = 0;
    std::string label;  // text before it in the prompt (a video frame's timestamp)
    uint64_t hash = 0;  // the item's hash, a video's mixed with the frame's number
  };
  struct Encoded {
    uint64_t hash = 0;
    std::vector<Block> blocks;
    size_t floats = 0;
  };
  // The items' encodings: from the kept ones by hash, the rest encoded together (encode_batch).
  std::vector<Encoded> encode(const std::vector<MediaItem>& items);
  Encoded keep(uint64_t hash, MediaEncoding&& m, const MediaItem& item);
  MediaEncoder& encoder();

  std::string path_;
  CheckpointOptions opts_;
  Backend& backend_;
  std::shared_ptr<const Checkpoint> ck_;
  std::unique_ptr<MediaEncoder> encoder_;
  std::mutex mu_;
  std::list<Encoded> recent_;  // most recent first
  size_t recent_floats_ = 0;
};

// 64-bit content hash of a media item (its kind and bytes).
uint64_t media_hash(const MediaItem& item);

}  // namespace mb
