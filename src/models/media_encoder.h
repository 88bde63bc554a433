// What the runtime sees of a model's media front-ends: files in, soft tokens out. Each
// architecture that reads images, audio or video builds one (Architecture::make_media_encoder) from
// its preprocessors and encoder towers; the runtime places the soft tokens in prompts (runtime/media.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mb {

struct MediaItem {
  enum class Kind { Image, Audio, Video };
  Kind kind = Kind::Image;
  std::vector<uint8_t> bytes;               // the file's contents, or
  std::vector<std::vector<uint8_t>> frames;  // a video given as frame images, in order (then `bytes` is empty)
  std::string what;                          // names it in errors (a path, "image 2 of the request")
};

// The ids a prompt marks media with: one placeholder per soft token between begin and end markers.
// Video frames are marked like images (begin, placeholders, end) with their own placeholder.
struct MediaTokenIds {
  int32_t image = -1, image_begin = -1, image_end = -1;
  int32_t audio = -1, audio_begin = -1, audio_end = -1;
  int32_t video = -1;
};

// A media item's soft tokens [n, hidden_size()] in blocks: one for an image or an audio clip, one per
// sampled frame for a video, each with the text the prompt puts before it (a frame's `MM:SS` timestamp).
struct MediaEncoding {
  struct Block {
    int64_t tokens = 0;
    std::string label;
  };
  std::vector<float> soft;
  std::vector<Block> blocks;
};

class MediaEncoder {
 public:
  virtual ~MediaEncoder() = default;
  virtual const MediaTokenIds& token_ids() const = 0;
  virtual int hidden_size() const = 0;  // width of a soft token (the language model's)
  // Throws mb::Error naming item.what for unreadable media and for a kind this model does not read.
  virtual MediaEncoding encode(const MediaItem& item) = 0;
  // Several items (a request's), in order; an encoder may run them through its towers together.
  virtual std::vector<MediaEncoding> encode_batch(const std::vector<const MediaItem*>& items) {
    std::vector<MediaEncoding> out;
    for (const MediaItem* it : items) out.push_back(encode(*it));
    return out;
  }
};

}  // namespace mb
