// Video in: frames sampled from a video file (libavformat/libavcodec/libswscale from Debian) or from a folder
// of frame images. No model knowledge: which frames to keep is the caller's `pick`, the model's frame sampling.
// Mirrors transformers' PyAV loader (`video_utils.read_video_pyav`, 5.17.0): the frame count is the stream's
// `nb_frames` (frames counted by demuxing where the container does not record it), the rate is the stream's
// average frame rate, frames are numbered in decode order and converted with `to_ndarray(format="rgb24")`,
// i.e. swscale to RGB24 (alpha dropped) at the coded size.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "media/image.h"

namespace mb {

// Refused before decoding: longer streams, larger frames (each frame's size is also checked as decoded).
inline constexpr int64_t kMaxVideoFrames = 1 << 20;
inline constexpr int kMaxVideoFramesKept = 1024;
inline constexpr size_t kMaxVideoRgbBytes = size_t(4) << 30;  // the kept frames' RGB, all together

struct VideoFrames {
  std::vector<RgbImage> frames;   // the picked frames, in order
  std::vector<int64_t> indices;   // their numbers among all frames
  int64_t total_frames = 0;
  double fps = 0;                 // 0: not known (a folder of frames, a stream without a rate)
};

// Given the total frame count and the rate (0 when unknown), the frame numbers to keep: increasing, each in
// [0, total).
using FramePicker = std::function<std::vector<int64_t>(int64_t total_frames, double fps)>;

// True when this build decodes video files (libavformat was found); folders of frames work either way.
bool video_files_supported();

// Decodes a video file held in memory (any container/codec the system's libavformat reads: MP4, MKV, WebM,
// MOV, AVI, ...; the first video stream). Throws mb::Error naming `what` for empty, corrupt or truncated
// input, no video stream, an unsupported codec, oversized frames, zero frames, or picks out of range.
VideoFrames decode_video(std::span<const uint8_t> bytes, const std::string& what, const FramePicker& pick);

// Frames given one image file each (a folder's files in name order, or a request's list): decoded as images
// (media/image.h), all of the same size, no rate.
VideoFrames decode_video_frames(const std::vector<std::vector<uint8_t>>& images, const std::string& what,
                                const FramePicker& pick);

// The image files of a folder, in name order (files only; hidden files skipped). Throws for a folder without
// any, or one with more than kMaxVideoFramesKept.
std::vector<std::string> list_frame_files(const std::string& dir);

}  // namespace mb
