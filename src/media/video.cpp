#include "media/video.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>

#include "core/error.h"

#ifdef MARKBASE_HAVE_LIBAV
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/imgutils.h>
#include <libswscale/swscale.h>
}
#endif

namespace mb {

namespace {

void check_picks(const std::vector<int64_t>& picks, int64_t total, const std::string& what) {
  MB_CHECK(!picks.empty(), "{}: no frames were picked of its {}", what, total);
  MB_CHECK(int64_t(picks.size()) <= kMaxVideoFramesKept, "{}: {} frames picked, more than the {} allowed", what,
           picks.size(), kMaxVideoFramesKept);
  for (size_t i = 0; i < picks.size(); ++i)
    MB_CHECK(picks[i] >= 0 && picks[i] < total && (i == 0 || picks[i] > picks[i - 1]),
             "{}: frame {} picked of {} frames (picks must increase)", what, picks[i], total);
}

#ifdef MARKBASE_HAVE_LIBAV
std::string av_message(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(err, buf, sizeof buf);
  return buf;
}

// libavformat reads the file from memory through this cursor (the request's bytes are never written to disk).
struct MemoryReader {
  std::span<const uint8_t> data;
  int64_t pos = 0;

  static int read(void* opaque, uint8_t* buf, int size) {
    auto* r = static_cast<MemoryReader*>(opaque);
    const int64_t left = int64_t(r->data.size()) - r->pos;
    if (left <= 0) return AVERROR_EOF;
    const int n = int(std::min<int64_t>(size, left));
    std::memcpy(buf, r->data.data() + r->pos, size_t(n));
    r->pos += n;
    return n;
  }
  static int64_t seek(void* opaque, int64_t offset, int whence) {
    auto* r = static_cast<MemoryReader*>(opaque);
    const int64_t size = int64_t(r->data.size());
    if ((whence & ~AVSEEK_FORCE) == AVSEEK_SIZE) return size;
    int64_t to = offset;
    switch (whence & ~AVSEEK_FORCE) {
      case SEEK_SET: break;
      case SEEK_CUR: to = r->pos + offset; break;
      case SEEK_END: to = size + offset; break;
      default: return -1;
    }
    if (to < 0 || to > size) return -1;
    r->pos = to;
    return to;
  }
};

// The demuxer over a MemoryReader, freed in the right order whichever way the decode ends.
struct Demuxer {
  MemoryReader reader;
  AVIOContext* io = nullptr;
  AVFormatContext* fmt = nullptr;
  AVCodecContext* codec = nullptr;
  int stream = -1;

  ~Demuxer() {
    avcodec_free_context(&codec);
    avformat_close_input(&fmt);  // does not free a custom AVIOContext
    if (io) av_freep(&io->buffer);
    avio_context_free(&io);
  }

  void open(std::span<const uint8_t> bytes, const std::string& what) {
    reader.data = bytes;
    reader.pos = 0;
    constexpr int kBuffer = 1 << 16;
    auto* buf = static_cast<uint8_t*>(av_malloc(kBuffer));
    MB_CHECK(buf != nullptr, "{}: out of memory", what);
    io = avio_alloc_context(buf, kBuffer, 0, &reader, &MemoryReader::read, nullptr, &MemoryReader::seek);
    if (!io) {
      av_free(buf);
      fail("{}: out of memory", what);
    }
    open_format(what);
    stream = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
    MB_CHECK(stream >= 0, "{}: the file has no video stream", what);
  }

  // The container over `io`, read from its start.
  void open_format(const std::string& what) {
    fmt = avformat_alloc_context();
    MB_CHECK(fmt != nullptr, "{}: out of memory", what);
    fmt->pb = io;
    fmt->flags |= AVFMT_FLAG_CUSTOM_IO;
    int err = avformat_open_input(&fmt, nullptr, nullptr, nullptr);
    if (err < 0) {
      fmt = nullptr;  // freed by avformat_open_input on failure
      fail("{}: not a video file libavformat can read ({})", what, av_message(err));
    }
    err = avformat_find_stream_info(fmt, nullptr);
    MB_CHECK(err >= 0, "{}: corrupt or truncated video ({})", what, av_message(err));
  }

  void open_decoder(const std::string& what) {
    const AVCodecParameters* par = fmt->streams[stream]->codecpar;
    const AVCodec* dec = avcodec_find_decoder(par->codec_id);
    MB_CHECK(dec != nullptr, "{}: its video codec ({}) is not supported by this system's libavcodec", what,
             avcodec_get_name(par->codec_id));
    MB_CHECK(par->width > 0 && par->height > 0 && par->width <= kMaxImageSide && par->height <= kMaxImageSide &&
                 int64_t(par->width) * par->height <= kMaxImagePixels,
             "{}: frames of {}x{} (at most {} per side and {} pixels)", what, par->width, par->height, kMaxImageSide,
             kMaxImagePixels);
    codec = avcodec_alloc_context3(dec);
    MB_CHECK(codec != nullptr, "{}: out of memory", what);
    int err = avcodec_parameters_to_context(codec, par);
    MB_CHECK(err >= 0, "{}: bad codec parameters ({})", what, av_message(err));
    codec->thread_count = 1;  // frames in decode order on this thread; the pick is cheap next to the encoder
    err = avcodec_open2(codec, dec, nullptr);
    MB_CHECK(err >= 0, "{}: cannot open the {} decoder ({})", what, dec->name, av_message(err));
  }

  // The stream's frame count as the container records it, else its packets counted (then rewound).
  int64_t frame_count(const std::string& what) {
    const AVStream* s = fmt->streams[stream];
    if (s->nb_frames > 0) {
      MB_CHECK(s->nb_frames <= kMaxVideoFrames, "{}: {} frames, more than the {} allowed", what, s->nb_frames,
               kMaxVideoFrames);
      return s->nb_frames;
    }
    int64_t n = 0;
    AVPacket* pkt = av_packet_alloc();
    MB_CHECK(pkt != nullptr, "{}: out of memory", what);
    while (av_read_frame(fmt, pkt) >= 0) {
      if (pkt->stream_index == stream) ++n;
      av_packet_unref(pkt);
      if (n > kMaxVideoFrames) break;
    }
    av_packet_free(&pkt);
    MB_CHECK(n <= kMaxVideoFrames, "{}: more than the {} frames allowed", what, kMaxVideoFrames);
    const int err = av_seek_frame(fmt, stream, 0, AVSEEK_FLAG_BACKWARD | AVSEEK_FLAG_ANY);
    if (err < 0) {  // a stream that cannot seek: read it again from the top
      avformat_close_input(&fmt);
      reader.pos = 0;
      avio_flush(io);
      avio_seek(io, 0, SEEK_SET);
      open_format(what);
    }
    return n;
  }
};

// One decoded frame as RGB24 at its coded size (swscale, as PyAV's to_ndarray("rgb24"): bilinear flags, the
// frame's own colour space and range).
RgbImage to_rgb(const AVFrame* f, const std::string& what) {
  MB_CHECK(f->width > 0 && f->height > 0 && f->width <= kMaxImageSide && f->height <= kMaxImageSide &&
               int64_t(f->width) * f->height <= kMaxImagePixels,
           "{}: a frame of {}x{}", what, f->width, f->height);
  const auto src_fmt = AVPixelFormat(f->format);
  SwsContext* sws = sws_getContext(f->width, f->height, src_fmt, f->width, f->height, AV_PIX_FMT_RGB24, SWS_BILINEAR,
                                   nullptr, nullptr, nullptr);
  MB_CHECK(sws != nullptr, "{}: cannot convert its {} frames to RGB", what, av_get_pix_fmt_name(src_fmt));
  std::unique_ptr<SwsContext, void (*)(SwsContext*)> guard(sws, sws_freeContext);
  int* inv_table = nullptr;
  int* table = nullptr;
  int src_range = 0, dst_range = 0, brightness = 0, contrast = 0, saturation = 0;
  if (sws_getColorspaceDetails(sws, &inv_table, &src_range, &table, &dst_range, &brightness, &contrast, &saturation) >=
      0) {
    const int space = f->colorspace == AVCOL_SPC_UNSPECIFIED ? SWS_CS_DEFAULT : int(f->colorspace);
    const int full = f->color_range == AVCOL_RANGE_JPEG ? 1 : src_range;
    sws_setColorspaceDetails(sws, sws_getCoefficients(space), full, sws_getCoefficients(SWS_CS_DEFAULT), 1,
                             brightness, contrast, saturation);
  }
  RgbImage img;
  img.width = f->width;
  img.height = f->height;
  img.rgb.resize(size_t(f->width) * size_t(f->height) * 3);
  uint8_t* dst[4] = {img.rgb.data(), nullptr, nullptr, nullptr};
  int dst_stride[4] = {f->width * 3, 0, 0, 0};
  const int rows = sws_scale(sws, f->data, f->linesize, 0, f->height, dst, dst_stride);
  MB_CHECK(rows == f->height, "{}: frame conversion to RGB failed", what);
  return img;
}
#endif

}  // namespace

bool video_files_supported() {
#ifdef MARKBASE_HAVE_LIBAV
  return true;
#else
  return false;
#endif
}

VideoFrames decode_video(std::span<const uint8_t> bytes, const std::string& what, const FramePicker& pick) {
  MB_CHECK(!bytes.empty(), "{}: the file is empty", what);
#ifndef MARKBASE_HAVE_LIBAV
  (void)pick;
  fail("{}: this build of markbase reads no video files (it was built without libavformat); give a folder of "
       "frame images instead",
       what);
#else
  av_log_set_level(AV_LOG_QUIET);  // errors reach the user through the exceptions below, not libav's stderr
  Demuxer d;
  d.open(bytes, what);
  d.open_decoder(what);
  VideoFrames out;
  out.total_frames = d.frame_count(what);
  MB_CHECK(out.total_frames > 0, "{}: the video has no frames", what);
  const AVStream* s = d.fmt->streams[d.stream];
  out.fps = s->avg_frame_rate.num > 0 && s->avg_frame_rate.den > 0 ? av_q2d(s->avg_frame_rate) : 0.0;
  out.indices = pick(out.total_frames, out.fps);
  check_picks(out.indices, out.total_frames, what);

  AVPacket* pkt = av_packet_alloc();
  AVFrame* frame = av_frame_alloc();
  std::unique_ptr<AVPacket, void (*)(AVPacket*)> pkt_guard(pkt, [](AVPacket* p) { av_packet_free(&p); });
  std::unique_ptr<AVFrame, void (*)(AVFrame*)> frame_guard(frame, [](AVFrame* f) { av_frame_free(&f); });
  MB_CHECK(pkt && frame, "{}: out of memory", what);
  int64_t n = 0;  // frames decoded so far
  size_t next = 0, kept_bytes = 0;
  auto drain = [&]() {
    for (;;) {
      const int err = avcodec_receive_frame(d.codec, frame);
      if (err == AVERROR(EAGAIN) || err == AVERROR_EOF) return;
      MB_CHECK(err >= 0, "{}: corrupt video frame {} ({})", what, n, av_message(err));
      if (next < out.indices.size() && out.indices[next] == n) {
        out.frames.push_back(to_rgb(frame, what));
        kept_bytes += out.frames.back().rgb.size();
        MB_CHECK(kept_bytes <= kMaxVideoRgbBytes, "{}: {} frames of {}x{} are more than the {} GiB of pixels allowed",
                 what, out.indices.size(), frame->width, frame->height, kMaxVideoRgbBytes >> 30);
        ++next;
      }
      ++n;
      av_frame_unref(frame);
    }
  };
  bool eof = false;
  while (next < out.indices.size() && !eof) {
    const int err = av_read_frame(d.fmt, pkt);
    if (err < 0) {
      eof = true;
      avcodec_send_packet(d.codec, nullptr);  // flush the frames the decoder still holds
    } else {
      if (pkt->stream_index == d.stream) {
        const int sent = avcodec_send_packet(d.codec, pkt);
        MB_CHECK(sent >= 0 || sent == AVERROR(EAGAIN), "{}: corrupt video data at frame {} ({})", what, n,
                 av_message(sent));
      }
      av_packet_unref(pkt);
    }
    drain();
  }
  MB_CHECK(next == out.indices.size(),
           "{}: the video is truncated: {} frames decoded of the {} its header claims (frame {} was wanted)", what, n,
           out.total_frames, out.indices[next]);
  return out;
#endif
}

VideoFrames decode_video_frames(const std::vector<std::vector<uint8_t>>& images, const std::string& what,
                                const FramePicker& pick) {
  MB_CHECK(!images.empty(), "{}: no frames", what);
  MB_CHECK(int64_t(images.size()) <= kMaxVideoFrames, "{}: {} frames, more than the {} allowed", what, images.size(),
           kMaxVideoFrames);
  VideoFrames out;
  out.total_frames = int64_t(images.size());
  out.indices = pick(out.total_frames, 0.0);
  check_picks(out.indices, out.total_frames, what);
  size_t kept_bytes = 0;
  for (int64_t i : out.indices) {
    out.frames.push_back(decode_image(images[size_t(i)], fmt::format("{} (frame {})", what, i)));
    const RgbImage& f = out.frames.back();
    kept_bytes += f.rgb.size();
    MB_CHECK(kept_bytes <= kMaxVideoRgbBytes, "{}: {} frames of {}x{} are more than the {} GiB of pixels allowed", what,
             out.indices.size(), f.width, f.height, kMaxVideoRgbBytes >> 30);
    MB_CHECK(f.width == out.frames.front().width && f.height == out.frames.front().height,
             "{}: frame {} is {}x{} but the first is {}x{} (a video's frames share one size)", what, i, f.width,
             f.height, out.frames.front().width, out.frames.front().height);
  }
  return out;
}

std::vector<std::string> list_frame_files(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  MB_CHECK(fs::is_directory(dir, ec), "{}: not a folder", dir);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] == '.' || !e.is_regular_file()) continue;
    files.push_back(e.path().string());
    MB_CHECK(int64_t(files.size()) <= kMaxVideoFramesKept,
             "{}: more than {} frame images (give a video file instead)", dir, kMaxVideoFramesKept);
  }
  MB_CHECK(!ec, "{}: cannot list the folder: {}", dir, ec.message());
  MB_CHECK(!files.empty(), "{}: the folder holds no frame images", dir);
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace mb
