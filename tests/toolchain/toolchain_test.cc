// Proves the C++ toolchain links: gtest, Abseil (StatusOr, StrFormat, flags, Mutex),
// OpenBLAS (OpenMP variant), OpenMP and nlohmann::json.
#include <cblas.h>
#include <omp.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, toolchain_smoke_flag, 7, "Only here to prove absl flags link.");

namespace {

absl::StatusOr<int> ParsePositive(int v) {
  if (v <= 0) return absl::InvalidArgumentError(absl::StrFormat("not positive: %d", v));
  return v;
}

TEST(Toolchain, AbslStatusOr) {
  absl::StatusOr<int> ok = ParsePositive(3);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 3);
  absl::StatusOr<int> bad = ParsePositive(-1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "not positive: -1");
  EXPECT_EQ(absl::StrCat("a", 1), "a1");
  EXPECT_EQ(absl::GetFlag(FLAGS_toolchain_smoke_flag), 7);
  absl::BitGen gen;
  int r = absl::Uniform(gen, 0, 10);
  EXPECT_GE(r, 0);
  EXPECT_LT(r, 10);
}

TEST(Toolchain, CblasSgemm) {
  // C = A(2x3) * B(3x2), row-major.
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {7, 8, 9, 10, 11, 12};
  std::vector<float> c(4, 0.0f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  EXPECT_FLOAT_EQ(c[0], 58);
  EXPECT_FLOAT_EQ(c[1], 64);
  EXPECT_FLOAT_EQ(c[2], 139);
  EXPECT_FLOAT_EQ(c[3], 154);
  // The OpenMP build of OpenBLAS reports parallel mode 2 (OpenMP).
  EXPECT_EQ(openblas_get_parallel(), 2);
}

TEST(Toolchain, OpenMP) {
  constexpr int kN = 100000;
  long long sum = 0;
  int threads_seen = 0;
  absl::Mutex mu;
#pragma omp parallel num_threads(2) reduction(+ : sum)
  {
#pragma omp single
    threads_seen = omp_get_num_threads();
#pragma omp for
    for (int i = 0; i < kN; ++i) sum += i;
    absl::MutexLock lock(&mu);
  }
  EXPECT_EQ(sum, static_cast<long long>(kN) * (kN - 1) / 2);
  EXPECT_EQ(threads_seen, 2);
}

TEST(Toolchain, NlohmannJson) {
  nlohmann::json j = nlohmann::json::parse(R"({"d_model": 64, "name": "tiny"})");
  EXPECT_EQ(j["d_model"].get<int>(), 64);
  EXPECT_EQ(j["name"].get<std::string>(), "tiny");
  j["layers"] = 2;
  EXPECT_EQ(nlohmann::json::parse(j.dump())["layers"], 2);
}

}  // namespace
