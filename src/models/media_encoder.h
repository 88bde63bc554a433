// What the runtime sees of a model's media front-ends: files in, soft tokens out. Each
// architecture that reads images or audio builds one (Architecture::make_media_encoder) from its
// preprocessors and encoder towers; the runtime places the soft tokens in prompts (runtime/media.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mb {

struct MediaItem {
  enum class Kind { Image, Audio };
  Kind kind = Kind::Image;
  std::vector<uint8_t> bytes;  // the file's contents
  std::string what;            // names it in errors (a path, "image 2 of the request")
};

// The ids a prompt marks media with: one placeholder per soft token between begin and end markers.
struct MediaTokenIds {
  int32_t image = -1, image_begin = -1, image_end = -1;
  int32_t audio = -1, audio_begin = -1, audio_end = -1;
};

class MediaEncoder {
 public:
  virtual ~MediaEncoder() = default;
  virtual const MediaTokenIds& token_ids() const = 0;
  virtual int hidden_size() const = 0;  // width of a soft token (the language model's)
  // Soft tokens [n, hidden_size()] of one image or audio clip; throws mb::Error naming item.what for
  // unreadable media and for a kind this model does not read.
  virtual std::vector<float> encode(const MediaItem& item) = 0;
};

}  // namespace mb
