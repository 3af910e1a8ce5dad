// Runs every fuzz target (targets.h) on its checked-in seed corpus, then on mutations of it for a bounded time
// (SG_FUZZ_SECONDS per target, default 5; deterministic in SG_FUZZ_SEED). Built with the project's compiler, so it
// runs in every `bazel test` and, in CI, under --config=asan, where a stray read, a leak or undefined behaviour
// aborts it. An input that takes longer than kSlowInput fails the test as a hang, shown in hex.
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/fuzz/targets.h"

namespace sg::fuzz {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kSlowInput = std::chrono::seconds(5);

std::vector<std::string> Corpus(const std::string& name) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string dir = absl::StrCat(srcdir ? srcdir : ".", "/", workspace ? workspace : "seqgrad",
                                       "/tests/fuzz/corpus/", name);
  std::vector<std::string> files;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') files.push_back(dir + "/" + e->d_name);
    closedir(d);
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> inputs;
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    inputs.push_back(bytes.str());
  }
  return inputs;
}

// Pieces that reach the readers' edge cases quickly.
const std::vector<std::string>& Dictionary() {
  static const std::vector<std::string> words = {
      "{", "}", "[", "]", ",", ":", "\"", "\\u0000", std::string(1, '\0'), "\n", "-100", "-1", "0", "1e400",
      "18446744073709551516", "18446744073709551615", "9223372036854775807", "4611686018427387904",
      "2147483648", "1e-400", "null", "true", "\"input_ids\"", "\"labels\"", "\"vocab_size\"", "\"hidden_size\"",
      "\"state_size\"", "\"head_dim\"", "\"num_hidden_layers\"", "\"data_offsets\"", "\"shape\"", "\"dtype\"",
      "\"F32\"", "\"weight_map\"", "\"__metadata__\"", "\"prompt\"", "\"chosen\"", "\"completions\""};
  return words;
}

std::string Mutate(std::string s, const std::vector<std::string>& corpus, std::mt19937_64& rng) {
  auto below = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  for (int k = 1 + static_cast<int>(below(4)); k > 0; --k) {
    const size_t at = below(s.size() + 1);
    switch (below(7)) {
      case 0:
        if (!s.empty()) s[below(s.size())] ^= static_cast<char>(1 << below(8));
        break;
      case 1:
        s.insert(at, 1, static_cast<char>(rng()));
        break;
      case 2:
        s.erase(at, below(16));
        break;
      case 3:
        s.insert(at, Dictionary()[below(Dictionary().size())]);
        break;
      case 4: {  // repeat a piece: long lines, deep nesting, many keys
        const std::string piece = s.substr(at, 1 + below(8));
        std::string repeated;
        for (size_t n = 1 + below(512); n > 0; --n) repeated += piece;
        s.insert(at, repeated);
        break;
      }
      case 5: {  // splice with another input
        const std::string& other = corpus[below(corpus.size())];
        s = s.substr(0, at) + other.substr(std::min(other.size(), below(other.size() + 1)));
        break;
      }
      default:
        if (!s.empty()) s[below(s.size())] = "0123456789-.e{}[]\"\n"[below(19)];
    }
  }
  return s.size() > (1 << 20) ? s.substr(0, 1 << 20) : s;
}

std::string Hex(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < std::min<size_t>(s.size(), 256); ++i) absl::StrAppend(&out, absl::Hex(static_cast<uint8_t>(s[i]), absl::kZeroPad2));
  return out;
}

class FuzzIo : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzIo, CorpusThenMutations) {
  const Target& target = GetParam();
  std::vector<std::string> corpus = Corpus(target.name);
  ASSERT_FALSE(corpus.empty()) << "no seed corpus in tests/fuzz/corpus/" << target.name;
  const char* seconds_env = std::getenv("SG_FUZZ_SECONDS");
  const char* seed_env = std::getenv("SG_FUZZ_SEED");
  const double seconds = seconds_env ? std::atof(seconds_env) : 5.0;
  std::mt19937_64 rng(seed_env ? std::strtoull(seed_env, nullptr, 10) : 20261123);
  auto run = [&](const std::string& input) {
    const Clock::time_point start = Clock::now();
    target.run(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    const auto took = Clock::now() - start;
    EXPECT_LT(took, kSlowInput) << target.name << ": an input of " << input.size()
                                << " bytes took too long (a hang?); first bytes: " << Hex(input);
  };
  for (const std::string& input : corpus) run(input);
  const Clock::time_point end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                     std::chrono::duration<double>(seconds));
  int64_t runs = 0;
  while (Clock::now() < end && !HasFailure()) {
    run(Mutate(corpus[rng() % corpus.size()], corpus, rng));
    ++runs;
  }
  std::printf("%s: %zu seeds, %lld mutated inputs\n", target.name, corpus.size(), static_cast<long long>(runs));
}

INSTANTIATE_TEST_SUITE_P(Readers, FuzzIo, ::testing::ValuesIn(kTargets),
                         [](const ::testing::TestParamInfo<Target>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace sg::fuzz
