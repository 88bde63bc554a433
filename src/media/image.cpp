// Decoders: stb_image (PNG, GIF, BMP), libjpeg-turbo and libwebp, plus the glue that makes their
// output match Pillow's (image.h). The resize is hand-written because no library reproduces PyTorch's integer
// arithmetic: it mirrors aten/src/ATen/native/cpu/UpSampleKernel.cpp
// (HelperInterpBase::_compute_index_ranges_weights / _compute_index_ranges_int16_weights,
// HelperInterpCubic::aa_filter) and UpSampleKernelAVXAntialias.h (upsample_avx_bilinear_bicubic_uint8,
// ImagingResampleHorizontal / ImagingResampleVertical), the path torch 2.x takes for a 3-channel
// uint8 image on x86 CPUs with AVX2 or AVX-512.
#include "media/image.h"

#include <webp/decode.h>
#include <webp/demux.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>

#include "core/error.h"
#include "core/thread_pool.h"

// After <cstdio>: jpeglib.h uses FILE without including it.
#include <jpeglib.h>
#include <jerror.h>

// stb_image's implementation, private to this file (STB_IMAGE_STATIC) and limited to the formats we
// accept. Sizes are checked against our own caps from the header (stbi_info) before decoding;
// STBI_MAX_DIMENSIONS is only a backstop.
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_NO_STDIO
#define STBI_FAILURE_USERMSG
#define STBI_ONLY_PNG
#define STBI_ONLY_GIF
#define STBI_ONLY_BMP
#define STBI_MAX_DIMENSIONS (1 << 20)
// Its helpers that this configuration leaves unused would warn.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#include <stb_image.h>
#pragma GCC diagnostic pop

namespace mb {

namespace {

// ---------------------------------------------------------------------------------------------
// Resize

// PyTorch's antialiased cubic filter: Keys' kernel with a = -0.5 (Pillow's), written with the same
// operation order as aten's cubic_convolution1/2 so that the double weights round identically.
double cubic_filter(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

// One axis of the separable resize: for output index i, input taps [first[i], first[i] + count[i])
// with int16 fixed-point weights weights[i * taps + j], scaled by 2^precision.
struct AxisWeights {
  int taps = 0;
  unsigned precision = 0;
  bool sums_fit_int32 = false;  // 255 · Σ|weights| + rounding < 2^31 for every output index
  std::vector<int64_t> first, count;
  std::vector<int16_t> weights;
};

AxisWeights axis_weights(int64_t in_size, int64_t out_size) {
  constexpr double kInterpSize = 4;  // bicubic
  const double scale = double(in_size) / double(out_size);
  const double support = scale >= 1.0 ? (kInterpSize * 0.5) * scale : kInterpSize * 0.5;
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;

  AxisWeights ax;
  ax.taps = int(std::ceil(support)) * 2 + 1;
  ax.first.resize(size_t(out_size));
  ax.count.resize(size_t(out_size));
  std::vector<double> w(size_t(out_size) * size_t(ax.taps), 0.0);
  double w_max = 0.0;
  for (int64_t i = 0; i < out_size; ++i) {
    const double center = scale * (double(i) + 0.5);
    const int64_t lo = std::max(static_cast<int64_t>(center - support + 0.5), int64_t(0));
    int64_t n = std::min(static_cast<int64_t>(center + support + 0.5), in_size) - lo;
    n = std::clamp(n, int64_t(0), int64_t(ax.taps));  // aten: rounding can add one tap too many
    double* wi = &w[size_t(i) * size_t(ax.taps)];
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      wi[j] = cubic_filter((double(j + lo) - center + 0.5) * invscale);
      total += wi[j];
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < n; ++j) {
        wi[j] /= total;
        w_max = std::max(w_max, wi[j]);
      }
    }
    ax.first[size_t(i)] = lo;
    ax.count[size_t(i)] = n;
  }
  // The largest precision (< 22 bits) at which the largest weight still fits in int16.
  unsigned precision = 0;
  for (; precision < 22; ++precision) {
    const int next = int(0.5 + w_max * double(1 << (precision + 1)));
    if (next >= (1 << 15)) break;
  }
  MB_CHECK(precision > 0, "resize: degenerate weights for {} -> {}", in_size, out_size);  // aten asserts too
  ax.precision = precision;
  ax.weights.resize(w.size());
  int64_t max_abs_sum = 0;
  for (int64_t i = 0; i < out_size; ++i) {
    int64_t abs_sum = 0;
    for (int j = 0; j < ax.taps; ++j) {
      const size_t k = size_t(i) * size_t(ax.taps) + size_t(j);
      const double v = w[k] * double(1 << precision);
      ax.weights[k] = int16_t(v < 0 ? int(-0.5 + v) : int(0.5 + v));
      abs_sum += std::abs(int64_t(ax.weights[k]));
    }
    max_abs_sum = std::max(max_abs_sum, abs_sum);
  }
  ax.sums_fit_int32 = 255 * max_abs_sum + (int64_t(1) << precision) < std::numeric_limits<int32_t>::max();
  return ax;
}

// Accumulators are int32 as in torch's kernels whenever the weights guarantee no overflow (always,
// in practice), which lets the compiler vectorise; int64 otherwise, with the same results.
template <class Acc>
uint8_t round_fixed_point(Acc acc, unsigned precision) {
  // Arithmetic shift (floor), then saturate, as _mm256_srai_epi32 + packs + packus do.
  return uint8_t(std::clamp<Acc>(Acc(acc >> precision), 0, 255));
}

// Resamples along x: rows stay, each output pixel mixes count[x] input pixels of its row.
template <class Acc>
void resample_horizontal(const AxisWeights& ax, const uint8_t* in, int in_w, int64_t y0, int64_t y1, uint8_t* out,
                         int out_w) {
  const Acc half = Acc(1) << (ax.precision - 1);
  for (int64_t y = y0; y < y1; ++y) {
    const uint8_t* row = in + size_t(y) * size_t(in_w) * 3;
    uint8_t* dst = out + size_t(y) * size_t(out_w) * 3;
    for (int x = 0; x < out_w; ++x) {
      const int16_t* k = &ax.weights[size_t(x) * size_t(ax.taps)];
      const uint8_t* src = row + ax.first[size_t(x)] * 3;
      Acc r = half, g = half, b = half;
      for (int64_t j = 0; j < ax.count[size_t(x)]; ++j, src += 3) {
        r += Acc(src[0]) * k[j];
        g += Acc(src[1]) * k[j];
        b += Acc(src[2]) * k[j];
      }
      dst[x * 3 + 0] = round_fixed_point(r, ax.precision);
      dst[x * 3 + 1] = round_fixed_point(g, ax.precision);
      dst[x * 3 + 2] = round_fixed_point(b, ax.precision);
    }
  }
}

// Resamples along y: each output row mixes count[y] input rows.
template <class Acc>
void resample_vertical(const AxisWeights& ax, const uint8_t* in, int w, uint8_t* out, int64_t y0, int64_t y1) {
  const size_t stride = size_t(w) * 3;
  std::vector<Acc> acc(stride);
  const Acc half = Acc(1) << (ax.precision - 1);
  for (int64_t y = y0; y < y1; ++y) {
    std::fill(acc.begin(), acc.end(), half);
    const int16_t* k = &ax.weights[size_t(y) * size_t(ax.taps)];
    for (int64_t j = 0; j < ax.count[size_t(y)]; ++j) {
      const uint8_t* src = in + size_t(ax.first[size_t(y)] + j) * stride;
      const Acc kj = k[j];
      for (size_t i = 0; i < stride; ++i) acc[i] += Acc(src[i]) * kj;
    }
    uint8_t* dst = out + size_t(y) * stride;
    for (size_t i = 0; i < stride; ++i) dst[i] = round_fixed_point(acc[i], ax.precision);
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding

enum class Format { Png, Jpeg, Gif, Bmp, Webp };

const char* format_name(Format f) {
  switch (f) {
    case Format::Png: return "PNG";
    case Format::Jpeg: return "JPEG";
    case Format::Gif: return "GIF";
    case Format::Bmp: return "BMP";
    case Format::Webp: return "WebP";
  }
  return "?";
}

bool starts_with(std::span<const uint8_t> b, size_t at, std::string_view magic) {
  return b.size() >= at + magic.size() && std::memcmp(b.data() + at, magic.data(), magic.size()) == 0;
}

std::optional<Format> sniff_format(std::span<const uint8_t> b) {
  if (starts_with(b, 0, "\x89PNG\r\n\x1a\n")) return Format::Png;
  if (starts_with(b, 0, "\xFF\xD8\xFF")) return Format::Jpeg;
  if (starts_with(b, 0, "GIF87a") || starts_with(b, 0, "GIF89a")) return Format::Gif;
  if (starts_with(b, 0, "BM")) return Format::Bmp;
  if (starts_with(b, 0, "RIFF") && starts_with(b, 8, "WEBP")) return Format::Webp;
  return std::nullopt;
}

uint32_t be16(const uint8_t* p) { return uint32_t(p[0]) << 8 | p[1]; }
uint32_t be32(const uint8_t* p) { return be16(p) << 16 | be16(p + 2); }
uint32_t le16(const uint8_t* p) { return uint32_t(p[1]) << 8 | p[0]; }
uint32_t le32(const uint8_t* p) { return le16(p + 2) << 16 | le16(p); }

void check_dimensions(int64_t w, int64_t h, const std::string& what) {
  MB_CHECK(w > 0 && h > 0, "{}: image has no pixels ({}x{})", what, w, h);
  MB_CHECK(w <= kMaxImageSide && h <= kMaxImageSide && w * h <= kMaxImagePixels,
           "{}: image is {}x{}, larger than the {} px a side / {} pixels this engine accepts", what, w, h,
           kMaxImageSide, kMaxImagePixels);
}

// ---- EXIF orientation (PIL.ImageOps.exif_transpose)

// The orientation tag (0x0112) of IFD0 in a TIFF-structured EXIF block; 1 (upright) when absent or
// unreadable. Every offset is checked against the block.
int exif_orientation(std::span<const uint8_t> exif) {
  if (starts_with(exif, 0, std::string_view("Exif\0\0", 6))) exif = exif.subspan(6);
  if (exif.size() < 8) return 1;
  const bool little = starts_with(exif, 0, "II");
  if (!little && !starts_with(exif, 0, "MM")) return 1;
  auto u16 = [&](size_t at) { return little ? le16(&exif[at]) : be16(&exif[at]); };
  auto u32 = [&](size_t at) { return little ? le32(&exif[at]) : be32(&exif[at]); };
  const size_t ifd = u32(4);
  if (ifd > exif.size() || exif.size() - ifd < 2) return 1;
  const size_t entries = u16(ifd);
  for (size_t e = 0; e < entries; ++e) {
    const size_t at = ifd + 2 + 12 * e;
    if (at > exif.size() || exif.size() - at < 12) return 1;
    if (u16(at) != 0x0112) continue;
    const uint32_t type = u16(at + 2), count = u32(at + 4);
    if (count != 1) return 1;
    if (type == 3) return int(u16(at + 8));  // SHORT
    if (type == 4) return int(std::min<uint32_t>(u32(at + 8), 9));  // LONG
    return 1;
  }
  return 1;
}

// Where Pillow finds EXIF: JPEG APP1 "Exif\0\0" (before the first scan), a PNG eXIf chunk, a WebP
// EXIF chunk. Empty when there is none.
std::span<const uint8_t> find_exif(std::span<const uint8_t> b, Format f) {
  if (f == Format::Jpeg) {
    size_t at = 2;
    while (at + 4 <= b.size() && b[at] == 0xFF) {
      const uint8_t marker = b[at + 1];
      if (marker == 0xFF) {  // fill byte
        ++at;
        continue;
      }
      if (marker == 0xDA || marker == 0xD9) break;  // start of scan / end of image
      const size_t len = be16(&b[at + 2]);
      if (len < 2 || at + 2 + len > b.size()) break;
      if (marker == 0xE1 && starts_with(b, at + 4, std::string_view("Exif\0\0", 6))) return b.subspan(at + 4, len - 2);
      at += 2 + len;
    }
  } else if (f == Format::Png) {
    size_t at = 8;
    while (at + 12 <= b.size()) {
      const size_t len = be32(&b[at]);
      if (len > b.size() - at - 12) break;
      if (starts_with(b, at + 4, "eXIf")) return b.subspan(at + 8, len);
      if (starts_with(b, at + 4, "IEND")) break;
      at += 12 + len;
    }
  } else if (f == Format::Webp) {
    size_t at = 12;
    while (at + 8 <= b.size()) {
      const size_t len = le32(&b[at + 4]);
      if (len > b.size() - at - 8) break;
      if (starts_with(b, at, "EXIF")) return b.subspan(at + 8, len);
      at += 8 + len + (len & 1);
    }
  }
  return {};
}

// `img` turned upright for EXIF orientation 2..8, with the transposes exif_transpose picks
// (2 mirror, 3 rotate 180, 4 flip, 5 transpose, 6 rotate 90 clockwise, 7 transverse, 8 rotate 90
// counter-clockwise).
RgbImage apply_orientation(RgbImage img, int orientation) {
  if (orientation < 2 || orientation > 8) return img;
  const int w = img.width, h = img.height;
  const bool swap = orientation >= 5;
  RgbImage out{swap ? h : w, swap ? w : h, std::vector<uint8_t>(img.rgb.size())};
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      int sx = x, sy = y;
      switch (orientation) {
        case 2: sx = w - 1 - x; break;
        case 3: sx = w - 1 - x; sy = h - 1 - y; break;
        case 4: sy = h - 1 - y; break;
        case 5: sx = y; sy = x; break;
        case 6: sx = y; sy = h - 1 - x; break;
        case 7: sx = w - 1 - y; sy = h - 1 - x; break;
        case 8: sx = w - 1 - y; sy = x; break;
      }
      std::memcpy(&out.rgb[(size_t(y) * size_t(out.width) + size_t(x)) * 3],
                  &img.rgb[(size_t(sy) * size_t(w) + size_t(sx)) * 3], 3);
    }
  }
  return out;
}

// ---- GIF: Pillow's first frame

// Pillow renders a GIF's first frame from palette indices: a transparent index shows its palette
// colour once converted to RGB, and pixels outside the frame's rectangle take the colour of the
// transparent index, or of index 0 when there is none. stb_image instead leaves transparent pixels
// black and fills the outside with the background colour. So before decoding, the transparency flag
// of the first frame's graphic control extension is cleared in a copy of the file, and afterwards
// the outside of the frame is painted as Pillow does.
struct GifFirstFrame {
  std::vector<uint8_t> bytes;  // the file with the first frame's transparency flag cleared
  int x = 0, y = 0, w = 0, h = 0;  // the first frame's rectangle on the logical screen
  uint8_t fill[3] = {0, 0, 0};
};

std::optional<GifFirstFrame> gif_first_frame(std::span<const uint8_t> b) {
  if (b.size() < 13) return std::nullopt;
  GifFirstFrame g;
  g.bytes.assign(b.begin(), b.end());
  size_t at = 13;
  std::span<const uint8_t> palette;
  if (b[10] & 0x80) {
    const size_t n = size_t(3) << ((b[10] & 7) + 1);
    if (b.size() - at < n) return std::nullopt;
    palette = b.subspan(at, n);
    at += n;
  }
  int transparent = -1;
  while (at < b.size()) {
    if (b[at] == 0x21) {  // extension: label, then data sub-blocks up to a zero length
      if (b.size() - at < 3) return std::nullopt;
      if (b[at + 1] == 0xF9 && b[at + 2] == 4 && b.size() - at >= 8) {
        transparent = (b[at + 3] & 1) ? b[at + 6] : -1;
        g.bytes[at + 3] &= uint8_t(~1u);
      }
      at += 2;
      while (at < b.size() && b[at] != 0) at += size_t(b[at]) + 1;
      ++at;
    } else if (b[at] == 0x2C) {  // image descriptor
      if (b.size() - at < 10) return std::nullopt;
      g.x = int(le16(&b[at + 1]));
      g.y = int(le16(&b[at + 3]));
      g.w = int(le16(&b[at + 5]));
      g.h = int(le16(&b[at + 7]));
      if (b[at + 9] & 0x80) {
        const size_t n = size_t(3) << ((b[at + 9] & 7) + 1);
        if (b.size() - at - 10 < n) return std::nullopt;
        palette = b.subspan(at + 10, n);
      }
      const size_t index = size_t(transparent >= 0 ? transparent : 0);
      if (3 * index + 3 <= palette.size()) std::memcpy(g.fill, &palette[3 * index], 3);
      return g;
    } else {
      return std::nullopt;  // trailer or garbage before any frame: stb_image reports it
    }
  }
  return std::nullopt;
}

// ---- stb_image and libwebp

struct StbFree {
  void operator()(void* p) const { stbi_image_free(p); }
};

[[noreturn]] void fail_decode(const std::string& what, Format f, const char* reason) {
  fail("{}: cannot decode this {} file: {}", what, format_name(f), reason ? reason : "unknown error");
}

// The size a PNG, GIF or BMP header declares, read here so that an oversized image gets our error
// rather than stb_image's generic one. Nullopt when the header is too short to say.
std::optional<std::pair<int64_t, int64_t>> declared_size(std::span<const uint8_t> b, Format f) {
  if (f == Format::Png && b.size() >= 24) return std::pair<int64_t, int64_t>(be32(&b[16]), be32(&b[20]));
  if (f == Format::Gif && b.size() >= 10) return std::pair<int64_t, int64_t>(le16(&b[6]), le16(&b[8]));
  if (f == Format::Bmp && b.size() >= 26) {
    if (le32(&b[14]) == 12) return std::pair<int64_t, int64_t>(le16(&b[18]), le16(&b[20]));  // OS/2 core header
    // Signed: a negative height means rows stored top-down.
    auto side = [&](size_t at) { return std::abs(int64_t(int32_t(le32(&b[at])))); };
    return std::pair<int64_t, int64_t>(side(18), side(22));
  }
  return std::nullopt;
}

RgbImage decode_with_stb(std::span<const uint8_t> b, Format f, const std::string& what) {
  MB_CHECK(b.size() <= size_t(std::numeric_limits<int>::max()), "{}: file too large ({} bytes)", what, b.size());
  if (const auto size = declared_size(b, f); size && size->first > 0 && size->second > 0)
    check_dimensions(size->first, size->second, what);
  const auto* data = b.data();
  const int len = int(b.size());
  int w = 0, h = 0, comp = 0;
  if (!stbi_info_from_memory(data, len, &w, &h, &comp)) fail_decode(what, f, stbi_failure_reason());
  check_dimensions(w, h, what);
  RgbImage img{w, h, {}};
  img.rgb.resize(size_t(w) * size_t(h) * 3);

  // Pillow opens 16-bit grey PNGs as "I;16", whose RGB conversion clips at 255 instead of keeping
  // the high byte (what it, and stb_image, do for every other 16-bit PNG).
  const bool grey16 = f == Format::Png && b.size() >= 26 && b[24] == 16 && b[25] == 0;
  if (grey16) {
    std::unique_ptr<stbi_us, StbFree> px(stbi_load_16_from_memory(data, len, &w, &h, &comp, 1));
    if (!px) fail_decode(what, f, stbi_failure_reason());
    for (size_t i = 0; i < size_t(w) * size_t(h); ++i)
      std::memset(&img.rgb[i * 3], std::min<int>(px.get()[i], 255), 3);
    return img;
  }

  std::optional<GifFirstFrame> gif;
  if (f == Format::Gif && (gif = gif_first_frame(b))) data = gif->bytes.data();
  std::unique_ptr<stbi_uc, StbFree> px(stbi_load_from_memory(data, len, &w, &h, &comp, 3));
  if (!px) fail_decode(what, f, stbi_failure_reason());
  MB_CHECK(w == img.width && h == img.height, "{}: inconsistent {} header", what, format_name(f));
  std::memcpy(img.rgb.data(), px.get(), img.rgb.size());
  if (gif) {
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        if (x < gif->x || x >= gif->x + gif->w || y < gif->y || y >= gif->y + gif->h)
          std::memcpy(&img.rgb[(size_t(y) * size_t(w) + size_t(x)) * 3], gif->fill, 3);
  }
  return img;
}

// ---- libjpeg(-turbo): the decoder Pillow is built on, so that JPEG pixels match Pillow's exactly
// (stb_image's own JPEG decoder differs by up to 3-6 levels on ~5 % of values). Same settings as
// Pillow's JpegDecode.c: integer slow IDCT, fancy upsampling, RGB output.

struct JpegErrors {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

extern "C" void jpeg_on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrors*>(cinfo->err);
  err->mgr.format_message(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

extern "C" void jpeg_on_message(j_common_ptr cinfo, int level) {
  // Warnings are ignored as Pillow does, except running out of data, which Pillow refuses
  // ("image file is truncated") and libjpeg would paper over with grey.
  auto* err = reinterpret_cast<JpegErrors*>(cinfo->err);
  if (level < 0 && err->mgr.msg_code == JWRN_JPEG_EOF) err->truncated = true;
}

// The pixel buffer for a w x h RGB image, or null to refuse it.
using JpegAllocate = uint8_t* (*)(void* ctx, int w, int h);

// Plain C-style control flow only: libjpeg reports errors by longjmp back here, so no object with
// a destructor may live in this frame. Returns false with `err->message` set on failure.
bool jpeg_decode(const uint8_t* data, size_t size, JpegErrors* err, JpegAllocate allocate, void* ctx) {
  jpeg_decompress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->mgr);
  err->mgr.error_exit = jpeg_on_error;
  err->mgr.emit_message = jpeg_on_message;
  err->message[0] = '\0';
  err->truncated = false;
  if (setjmp(err->jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(err->message, sizeof err->message, "CMYK JPEG is not supported");
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  uint8_t* out = allocate(ctx, int(cinfo.image_width), int(cinfo.image_height));
  if (!out) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_start_decompress(&cinfo);
  const size_t stride = size_t(cinfo.output_width) * 3;
  while (cinfo.output_scanline < cinfo.output_height && !err->truncated) {
    JSAMPROW row = out + size_t(cinfo.output_scanline) * stride;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  if (!err->truncated) jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (err->truncated) std::snprintf(err->message, sizeof err->message, "truncated file (premature end of data)");
  return !err->truncated;
}

RgbImage decode_jpeg(std::span<const uint8_t> b, const std::string& what) {
  struct Target {
    RgbImage img;
    const std::string* what;
    std::string refusal;
  } target{{}, &what, {}};
  auto allocate = [](void* ctx, int w, int h) -> uint8_t* {
    auto* t = static_cast<Target*>(ctx);
    try {
      check_dimensions(w, h, *t->what);
      t->img = RgbImage{w, h, std::vector<uint8_t>(size_t(w) * size_t(h) * 3)};
      return t->img.rgb.data();
    } catch (const std::exception& e) {
      t->refusal = e.what();
      return nullptr;
    }
  };
  JpegErrors err;
  if (!jpeg_decode(b.data(), b.size(), &err, allocate, &target)) {
    if (!target.refusal.empty()) throw Error(target.refusal);
    fail_decode(what, Format::Jpeg, err.message);
  }
  return std::move(target.img);
}

// An animated WebP as Pillow's WebPAnimDecoder shows its first frame: the frame's pixels at its
// offset on a canvas cleared to transparent black (black once alpha is dropped).
RgbImage decode_webp_first_frame(std::span<const uint8_t> b, const std::string& what) {
  const WebPData data{b.data(), b.size()};
  const std::unique_ptr<WebPDemuxer, decltype(&WebPDemuxDelete)> demux(WebPDemux(&data), &WebPDemuxDelete);
  if (!demux) fail_decode(what, Format::Webp, "corrupt or truncated animation");
  const int64_t w = WebPDemuxGetI(demux.get(), WEBP_FF_CANVAS_WIDTH);
  const int64_t h = WebPDemuxGetI(demux.get(), WEBP_FF_CANVAS_HEIGHT);
  check_dimensions(w, h, what);
  WebPIterator frame;
  if (!WebPDemuxGetFrame(demux.get(), 1, &frame)) fail_decode(what, Format::Webp, "animation without frames");
  const std::unique_ptr<WebPIterator, decltype(&WebPDemuxReleaseIterator)> release(&frame, &WebPDemuxReleaseIterator);
  if (frame.x_offset < 0 || frame.y_offset < 0 || frame.width <= 0 || frame.height <= 0 ||
      frame.x_offset + int64_t(frame.width) > w || frame.y_offset + int64_t(frame.height) > h)
    fail_decode(what, Format::Webp, "first frame outside the canvas");
  std::vector<uint8_t> pixels(size_t(frame.width) * size_t(frame.height) * 3);
  if (!WebPDecodeRGBInto(frame.fragment.bytes, frame.fragment.size, pixels.data(), pixels.size(), frame.width * 3))
    fail_decode(what, Format::Webp, "corrupt or truncated first frame");
  RgbImage img{int(w), int(h), std::vector<uint8_t>(size_t(w) * size_t(h) * 3, 0)};
  for (int y = 0; y < frame.height; ++y)
    std::memcpy(&img.rgb[(size_t(frame.y_offset + y) * size_t(w) + size_t(frame.x_offset)) * 3],
                &pixels[size_t(y) * size_t(frame.width) * 3], size_t(frame.width) * 3);
  return img;
}

RgbImage decode_webp(std::span<const uint8_t> b, const std::string& what) {
  WebPBitstreamFeatures features;
  const VP8StatusCode status = WebPGetFeatures(b.data(), b.size(), &features);
  if (status != VP8_STATUS_OK)
    fail_decode(what, Format::Webp, status == VP8_STATUS_NOT_ENOUGH_DATA ? "truncated" : "corrupt header");
  if (features.has_animation) return decode_webp_first_frame(b, what);
  check_dimensions(features.width, features.height, what);
  RgbImage img{features.width, features.height, {}};
  img.rgb.resize(size_t(img.width) * size_t(img.height) * 3);
  if (!WebPDecodeRGBInto(b.data(), b.size(), img.rgb.data(), img.rgb.size(), img.width * 3))
    fail_decode(what, Format::Webp, "corrupt or truncated image data");
  return img;
}

}  // namespace

RgbImage resize_bicubic_antialias(const RgbImage& src, int out_w, int out_h) {
  MB_CHECK(src.width > 0 && src.height > 0 && src.rgb.size() == size_t(src.width) * size_t(src.height) * 3,
           "resize: malformed {}x{} image with {} bytes", src.width, src.height, src.rgb.size());
  // Sides may exceed kMaxImageSide (a 1000x7 image fills a 280-token budget at 9600x48); the
  // pixel cap bounds the output and the horizontal pass's intermediate image.
  MB_CHECK(out_w > 0 && out_h > 0 && int64_t(out_w) * out_h <= kMaxImagePixels &&
               int64_t(out_w) * src.height <= kMaxImagePixels,
           "resize: {}x{} to {}x{} is out of range", src.width, src.height, out_w, out_h);
  // Like torch: horizontal pass first (rounded to uint8), then vertical; an unchanged axis is skipped.
  // Rows are independent in each pass: the pool's threads take runs of them (same integers).
  RgbImage out{out_w, out_h, {}};
  std::vector<uint8_t> horizontal;
  ThreadPool& pool = ThreadPool::global();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max(out_w, 1));
  if (out_w != src.width) {
    const AxisWeights ax = axis_weights(src.width, out_w);
    horizontal.resize(size_t(out_w) * size_t(src.height) * 3);
    pool.parallel_for(src.height, grain, [&](int64_t b, int64_t e) {
      if (ax.sums_fit_int32)
        resample_horizontal<int32_t>(ax, src.rgb.data(), src.width, b, e, horizontal.data(), out_w);
      else
        resample_horizontal<int64_t>(ax, src.rgb.data(), src.width, b, e, horizontal.data(), out_w);
    });
  }
  const uint8_t* rows = out_w != src.width ? horizontal.data() : src.rgb.data();
  if (out_h != src.height) {
    const AxisWeights ax = axis_weights(src.height, out_h);
    out.rgb.resize(size_t(out_w) * size_t(out_h) * 3);
    pool.parallel_for(out_h, grain, [&](int64_t b, int64_t e) {
      if (ax.sums_fit_int32)
        resample_vertical<int32_t>(ax, rows, out_w, out.rgb.data(), b, e);
      else
        resample_vertical<int64_t>(ax, rows, out_w, out.rgb.data(), b, e);
    });
  } else {
    out.rgb = out_w != src.width ? std::move(horizontal) : src.rgb;
  }
  return out;
}

RgbImage decode_image(std::span<const uint8_t> bytes, const std::string& what) {
  MB_CHECK(!bytes.empty(), "{}: empty file (0 bytes), not an image", what);
  const std::optional<Format> f = sniff_format(bytes);
  MB_CHECK(f.has_value(), "{}: not a supported image (PNG, JPEG, GIF, BMP or WebP expected)", what);
  RgbImage img = *f == Format::Webp   ? decode_webp(bytes, what)
                 : *f == Format::Jpeg ? decode_jpeg(bytes, what)
                                      : decode_with_stb(bytes, *f, what);
  return apply_orientation(std::move(img), exif_orientation(find_exif(bytes, *f)));
}

RgbImage read_image_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  MB_CHECK(in, "{}: cannot open image file", path);
  const std::streamoff size = in.tellg();
  MB_CHECK(size >= 0, "{}: cannot read image file", path);
  // The largest image we accept, uncompressed, plus headroom for metadata; anything bigger is not
  // worth reading into memory.
  constexpr std::streamoff kMaxFileBytes = std::streamoff(kMaxImagePixels) * 4 + (std::streamoff(64) << 20);
  MB_CHECK(size <= kMaxFileBytes, "{}: file too large for an image ({} bytes)", path, int64_t(size));
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), size);
  MB_CHECK(in.gcount() == size, "{}: read error", path);
  return decode_image(bytes, path);
}

}  // namespace mb
