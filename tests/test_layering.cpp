// The layers of src/ (README "Layout") include only what is below them, and architecture
// knowledge stays in src/models/<arch>/. Checked on the source text, so a change that breaks the
// layering fails here rather than in review.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;

struct SourceFile {
  std::string path;  // relative to src/
  std::string layer;  // its first directory: core, formats, ...
  std::string text;
};

std::vector<SourceFile> sources() {
  std::vector<SourceFile> out;
  const fs::path root = fs::path(mbtest::source_dir()) / "src";
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".inc" && ext != ".cu" && ext != ".cuh"))
      continue;
    std::ifstream in(e.path());
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string rel = fs::relative(e.path(), root).generic_string();
    out.push_back({rel, rel.substr(0, rel.find('/')), ss.str()});
  }
  return out;
}

// What each layer may include of the project's own headers ("markbase" is include/markbase/).
const std::map<std::string, std::set<std::string>>& allowed() {
  static const std::map<std::string, std::set<std::string>> m = {
      {"core", {"core"}},
      {"formats", {"core", "formats"}},
      {"tokenizer", {"core", "tokenizer"}},
      {"media", {"core", "media"}},
      {"backends", {"core", "backends"}},
      {"models", {"core", "formats", "tokenizer", "media", "backends", "models"}},
      {"runtime", {"core", "formats", "tokenizer", "media", "backends", "models", "runtime", "markbase"}},
      {"server", {"core", "formats", "tokenizer", "media", "backends", "models", "runtime", "markbase", "server"}},
      {"cli", {"core", "formats", "tokenizer", "media", "backends", "models", "runtime", "markbase", "server", "cli"}},
  };
  return m;
}

TEST(Layering, EachLayerIncludesOnlyTheLayersBelowIt) {
  const std::regex include(R"re(#\s*include\s*"([^"/]+)/([^"]+)")re");
  int checked = 0;
  for (const SourceFile& f : sources()) {
    auto rules = allowed().find(f.layer);
    ASSERT_NE(rules, allowed().end()) << "src/" << f.path << ": a layer the README does not list";
    for (std::sregex_iterator it(f.text.begin(), f.text.end(), include), end; it != end; ++it) {
      const std::string dir = (*it)[1], file = (*it)[2];
      ++checked;
      // The public error type is the one piece of the API the lowest layer throws.
      if (dir == "markbase" && file == "error.h") continue;
      EXPECT_TRUE(rules->second.count(dir)) << "src/" << f.path << " includes " << dir << "/" << file;
    }
  }
  EXPECT_GT(checked, 100);
}

// The models layer sees backends only through the op contract, never a backend's kernels.
TEST(Layering, ModelsUseTheBackendContractOnly) {
  const std::regex include(R"re(#\s*include\s*"backends/([^"]+)")re");
  for (const SourceFile& f : sources()) {
    if (f.layer != "models") continue;
    for (std::sregex_iterator it(f.text.begin(), f.text.end(), include), end; it != end; ++it)
      EXPECT_EQ((*it)[1], "backend.h") << "src/" << f.path;
  }
}

// Library code reports through return values and mb::Error; only the command line prints.
TEST(Layering, OnlyTheCommandLinePrints) {
  const std::regex print(R"re((\b(printf|fprintf|puts|fputs|perror)\s*\(|std::(cout|cerr|clog)\b))re");
  for (const SourceFile& f : sources()) {
    if (f.layer == "cli") continue;
    for (std::sregex_iterator it(f.text.begin(), f.text.end(), print), end; it != end; ++it)
      ADD_FAILURE() << "src/" << f.path << " prints with " << (*it)[1];
  }
}

// Architecture names and their HF classes are spelled only in their own folders (and in the
// Gemma 4 output parser, which the brief puts with the tokenizer).
TEST(Layering, ArchitecturesAreNamedOnlyInTheirFolders) {
  const std::regex name(R"re("(gemma[0-9][a-z_]*|Gemma[0-9][A-Za-z]*For[A-Za-z]+)")re");
  for (const SourceFile& f : sources()) {
    if (f.path.rfind("models/gemma", 0) == 0) continue;
    for (std::sregex_iterator it(f.text.begin(), f.text.end(), name), end; it != end; ++it)
      ADD_FAILURE() << "src/" << f.path << " names " << (*it)[1] << " outside src/models/<arch>/";
  }
}

}  // namespace
