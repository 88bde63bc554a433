// Tokenizer throughput on a deterministic 10 MB text, comparable with
// tools/reference/bench_tokenizers_py.py (same text, same units: MB/s = 1e6 bytes of UTF-8
// input per second; one encode() over the whole text, one decode() over all its ids).
//
//   MARKBASE_TOKENIZER_JSON=/path/to/gemma4-tokenizer.json ./markbase_bench --benchmark_filter=Tokenizer
// Without the variable, ../shared/data/tokenizer/gemma4-tokenizer.json (from the repo root) is used.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

constexpr size_t kTargetBytes = 10'000'000;
constexpr int kMultilingualRepeat = 16;
// Keep byte-identical with MULTILINGUAL in tools/reference/bench_tokenizers_py.py.
constexpr const char* kMultilingual =
    "机器学习是人工智能的一个分支，它使计算机能够在没有明确编程的情况下从数据中学习。"
    "深度学习模型通过多层神经网络提取特征，并在图像识别、语音识别和自然语言处理中取得了显著成果。\n"
    "東京は日本の首都であり、世界有数の大都市です。春には桜が咲き、多くの観光客が訪れます。\n"
    "서울은 대한민국의 수도이며 한강을 중심으로 발전한 도시입니다. 전통과 현대가 공존합니다.\n"
    "الذكاء الاصطناعي هو فرع من علوم الحاسوب يهدف إلى إنشاء أنظمة قادرة على أداء مهام تتطلب ذكاءً بشريًا.\n"
    "कृत्रिम बुद्धिमत्ता कंप्यूटर विज्ञान की एक शाखा है जो ऐसी मशीनें बनाने पर केंद्रित है जो सोच सकें।\n"
    "Машинное обучение позволяет компьютерам находить закономерности в больших объёмах данных.\n"
    "ปัญญาประดิษฐ์เป็นสาขาหนึ่งของวิทยาการคอมพิวเตอร์ที่มุ่งสร้างเครื่องจักรที่คิดได้\n"
    "Η τεχνητή νοημοσύνη αλλάζει τον τρόπο που εργαζόμαστε και επικοινωνούμε.\n"
    "Emoji: 🚀✨ 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 😀😃😄 — “quotes”, café, naïve, Zürich, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.\n"
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text if c.isalnum()]  # 123 4567\n";

std::string bench_text() {
  namespace fs = std::filesystem;
  std::vector<std::string> names;
  const fs::path dir = "/usr/share/common-licenses";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && !e.is_symlink()) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string unit;
  for (const auto& n : names) {
    std::ifstream f(dir / n, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    unit += ss.str();
  }
  for (int i = 0; i < kMultilingualRepeat; ++i) unit += kMultilingual;
  std::string data;
  data.reserve(kTargetBytes + unit.size());
  while (data.size() <= kTargetBytes) data += unit;
  size_t cut = kTargetBytes;
  while (cut > 0 && (static_cast<unsigned char>(data[cut]) & 0xC0) == 0x80) --cut;
  data.resize(cut);
  return data;
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ULL;
  return h;
}

std::string tokenizer_path() {
  if (const char* p = std::getenv("MARKBASE_TOKENIZER_JSON")) return p;
  return "../shared/data/tokenizer/gemma4-tokenizer.json";
}

struct Setup {
  std::optional<mb::Tokenizer> tok;
  std::string text;
  std::vector<int32_t> ids;
  std::string error;
};

const Setup& setup() {
  static const Setup s = [] {
    Setup s;
    try {
      s.tok = mb::Tokenizer::from_hf_json_file(tokenizer_path());
    } catch (const std::exception& e) {
      s.error = e.what();
      return s;
    }
    s.text = bench_text();
    s.ids = s.tok->encode(s.text);
    std::fprintf(stderr, "bench text: %zu bytes, fnv1a64 %016llx, %zu tokens\n", s.text.size(),
                 static_cast<unsigned long long>(fnv1a64(s.text)), s.ids.size());
    return s;
  }();
  return s;
}

void set_rate(benchmark::State& state, size_t bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["MB"] = benchmark::Counter(static_cast<double>(state.iterations() * bytes) / 1e6,
                                            benchmark::Counter::kIsRate);
}

void BM_TokenizerLoad(benchmark::State& state) {
  const std::string path = tokenizer_path();
  for (auto _ : state) {
    try {
      benchmark::DoNotOptimize(mb::Tokenizer::from_hf_json_file(path));
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      return;
    }
  }
}
BENCHMARK(BM_TokenizerLoad)->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_TokenizerEncode(benchmark::State& state) {
  const Setup& s = setup();
  if (!s.tok) return state.SkipWithError(s.error.c_str());
  for (auto _ : state) benchmark::DoNotOptimize(s.tok->encode(s.text));
  set_rate(state, s.text.size());
}
BENCHMARK(BM_TokenizerEncode)->Unit(benchmark::kMillisecond)->MinTime(2.0);

// Line by line, as prompts arrive: no cross-call caching helps here.
void BM_TokenizerEncodeLines(benchmark::State& state) {
  const Setup& s = setup();
  if (!s.tok) return state.SkipWithError(s.error.c_str());
  const std::string_view text = std::string_view(s.text).substr(0, 1'000'000);
  for (auto _ : state) {
    size_t pos = 0;
    while (pos < text.size()) {
      size_t end = std::min(text.find('\n', pos), text.size());
      benchmark::DoNotOptimize(s.tok->encode(text.substr(pos, end + 1 - pos)));
      pos = end + 1;
    }
  }
  set_rate(state, text.size());
}
BENCHMARK(BM_TokenizerEncodeLines)->Unit(benchmark::kMillisecond);

void BM_TokenizerDecode(benchmark::State& state) {
  const Setup& s = setup();
  if (!s.tok) return state.SkipWithError(s.error.c_str());
  for (auto _ : state) benchmark::DoNotOptimize(s.tok->decode(s.ids));
  set_rate(state, s.text.size());
}
BENCHMARK(BM_TokenizerDecode)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_TokenizerStreamingDecode(benchmark::State& state) {
  const Setup& s = setup();
  if (!s.tok) return state.SkipWithError(s.error.c_str());
  for (auto _ : state) {
    mb::StreamingDecoder dec(*s.tok);
    size_t n = 0;
    for (int32_t id : s.ids) n += dec.push(id).size();
    n += dec.flush().size();
    benchmark::DoNotOptimize(n);
  }
  set_rate(state, s.text.size());
}
BENCHMARK(BM_TokenizerStreamingDecode)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
