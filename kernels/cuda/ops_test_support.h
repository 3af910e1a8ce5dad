// What the tests of the CUDA op table share (ops_test.cc on a GPU or emulated, emulation/extra_ops_test.cc):
// guarded buffers on a device, named outputs, and their comparison against the CPU table's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/tensor.h"
#include "kernels/backend.h"

namespace sg {
namespace ops_test {

template <typename T> DType DTypeOf();
template <> inline DType DTypeOf<float>() { return DType::kF32; }
template <> inline DType DTypeOf<double>() { return DType::kF64; }
template <> inline DType DTypeOf<uint16_t>() { return DType::kBF16; }  // bf16 bits (--dtype=bf16 storage)
template <> inline DType DTypeOf<int32_t>() { return DType::kI32; }    // indices (expert picks, rows)

// An element as a number (bf16 bits widened).
inline double AsDouble(float x) { return x; }
inline double AsDouble(double x) { return x; }
inline double AsDouble(uint16_t bf16) { return BF16ToF32(bf16); }
inline double AsDouble(int32_t i) { return i; }

inline MemoryTracker* TrackerFor(Device d) {
  if (d == Device::kCPU) return nullptr;  // aligned host memory
  static MemoryTracker* cuda = [] {
    auto* t = new MemoryTracker;
    t->set_device(Device::kCUDA);  // device memory: written and read back through copies
    return t;
  }();
  return cuda;
}

// Elements on each side of every buffer: 67 leaves the data misaligned for any vector width (kernels must not
// assume alignment they did not check); kAlignedGuard keeps it 16-byte aligned (their vectorized paths).
constexpr int64_t kGuard = 67;
constexpr int64_t kAlignedGuard = 64;

template <typename T> T Sentinel() { return static_cast<T>(-7777.25); }
template <> inline uint16_t Sentinel<uint16_t>() { return F32ToBF16(-7777.25f); }
template <typename T> T Nan() { return std::numeric_limits<T>::quiet_NaN(); }
template <> inline uint16_t Nan<uint16_t>() { return F32ToBF16(std::numeric_limits<float>::quiet_NaN()); }

// n elements on device d (CPU: host memory; CUDA: device memory, written and read through copies) between two
// guard zones of `guard` elements holding a sentinel.
template <typename T>
class Buf {
 public:
  Buf(Device d, int64_t n, T init, std::string name, int64_t guard = kGuard)
      : Buf(d, std::vector<T>(n, init), std::move(name), guard) {}
  Buf(Device d, const std::vector<T>& v, std::string name, int64_t guard = kGuard)
      : n_(static_cast<int64_t>(v.size())), guard_(guard), name_(std::move(name)) {
    t_ = Tensor::Empty(TrackerFor(d), MemCategory::kWorkspace, DTypeOf<T>(), {n_ + 2 * guard_});
    std::vector<T> host(n_ + 2 * guard_, Sentinel<T>());
    std::copy(v.begin(), v.end(), host.begin() + guard_);
    CopyFromHost(t_, host.data());
  }
  T* data() const { return base() + guard_; }
  int64_t size() const { return n_; }
  const std::string& name() const { return name_; }
  // Fails the test (naming the buffer and the offset) if a guard element changed; returns whether all held.
  bool GuardsIntact() const {
    const T s = Sentinel<T>();
    const std::vector<T> host = HostCopy<T>(t_);
    const T* b = host.data();
    for (int64_t i = 0; i < n_ + 2 * guard_; ++i) {
      if (i >= guard_ && i < guard_ + n_) continue;
      if (std::memcmp(&b[i], &s, sizeof(T)) != 0) {
        const int64_t off = i < guard_ ? i - guard_ : i - guard_ - n_;
        ADD_FAILURE() << name_ << ": out-of-bounds write at " << (off < 0 ? "" : "end + ") << off << " (value "
                      << AsDouble(b[i]) << ")";
        return false;
      }
    }
    return true;
  }
  std::vector<T> Raw() const {
    GuardsIntact();
    const std::vector<T> host = HostCopy<T>(t_);
    return std::vector<T>(host.begin() + guard_, host.begin() + guard_ + n_);
  }
  std::vector<double> Values() const {
    const std::vector<T> raw = Raw();
    std::vector<double> v(n_);
    for (int64_t i = 0; i < n_; ++i) v[i] = AsDouble(raw[i]);
    return v;
  }

 private:
  T* base() const { return t_.data<T>(); }
  Tensor t_;
  int64_t n_, guard_;
  std::string name_;
};

// Host arrays the table takes as host memory (token_logprobs / token_argmax outputs), with guards too.
template <typename T>
class HostBuf {
 public:
  HostBuf(int64_t n, T init, std::string name) : v_(n + 2 * kGuard, Sentinel<T>()), n_(n), name_(std::move(name)) {
    std::fill(v_.begin() + kGuard, v_.begin() + kGuard + n, init);
  }
  T* data() { return v_.data() + kGuard; }
  std::vector<T> Raw() const {
    const T s = Sentinel<T>();
    for (int64_t i = 0; i < n_ + 2 * kGuard; ++i)
      if ((i < kGuard || i >= kGuard + n_) && std::memcmp(&v_[i], &s, sizeof(T)) != 0)
        ADD_FAILURE() << name_ << ": out-of-bounds write at host element " << i - kGuard;
    return std::vector<T>(v_.begin() + kGuard, v_.begin() + kGuard + n_);
  }

 private:
  std::vector<T> v_;
  int64_t n_;
  std::string name_;
};

// Named outputs of one run, in the order the run lists them.
struct Outs {
  std::vector<std::pair<std::string, std::vector<double>>> v;
  double scalar = 0;  // an op's return value, when it has one
  template <typename T>
  void Add(const Buf<T>& b) { v.emplace_back(b.name(), b.Values()); }
  void Add(const std::string& name, std::vector<double> x) { v.emplace_back(name, std::move(x)); }
};

// max |got - ref| / max |ref|; NaN in exactly one of them counts as infinite.
inline double RelErr(const std::vector<double>& got, const std::vector<double>& ref, size_t* worst) {
  double err = 0, scale = 0;
  *worst = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) scale = std::max(scale, std::abs(ref[i]));
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool gn = std::isnan(got[i]), rn = std::isnan(ref[i]);
    double e;
    if (gn || rn) e = gn && rn ? 0 : std::numeric_limits<double>::infinity();
    else if (got[i] == ref[i]) e = 0;  // also equal infinities
    else e = std::abs(got[i] - ref[i]);
    if (e > err) {
      err = e;
      *worst = i;
    }
  }
  if (err == 0) return 0;
  return err / std::max(scale, std::numeric_limits<double>::min());
}

inline void ExpectClose(const std::vector<double>& got, const std::vector<double>& ref, double tol,
                        const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t worst = 0;
  const double err = RelErr(got, ref, &worst);
  EXPECT_LE(err, tol) << what << ": max |cuda - cpu| / max |cpu| = " << err << ", worst at element " << worst
                      << " (cuda " << got[worst] << ", cpu " << ref[worst] << ")";
}

// Every output of the device run against the CPU run's.
inline void ExpectAllClose(const Outs& dut, const Outs& cpu, double tol, const std::string& what) {
  ASSERT_EQ(dut.v.size(), cpu.v.size());
  for (size_t i = 0; i < cpu.v.size(); ++i) ExpectClose(dut.v[i].second, cpu.v[i].second, tol, what + " " + cpu.v[i].first);
}

inline void ExpectAllEqual(const Outs& dut, const Outs& cpu, const std::string& what) {
  ASSERT_EQ(dut.v.size(), cpu.v.size());
  for (size_t i = 0; i < cpu.v.size(); ++i) {
    const auto& g = dut.v[i].second;
    const auto& r = cpu.v[i].second;
    ASSERT_EQ(g.size(), r.size());
    int64_t bad = 0;
    size_t first = 0;
    for (size_t j = 0; j < r.size(); ++j)
      if (!(g[j] == r[j] || (std::isnan(g[j]) && std::isnan(r[j]))) && bad++ == 0) first = j;
    EXPECT_EQ(bad, 0) << what << " " << cpu.v[i].first << ": " << bad << " elements differ, first at " << first
                      << " (cuda " << g[first] << ", cpu " << r[first] << ")";
  }
}

// Tolerances relative to the largest reference entry: f32 "tight" for short reductions and pointwise ops, "loose"
// for long reductions (attention gradients, scans, sums over many rows); f64 near rounding either way.
template <typename T> constexpr double kTight = std::is_same_v<T, float> ? 1e-5 : 1e-12;
template <typename T> constexpr double kLoose = std::is_same_v<T, float> ? 5e-5 : 1e-11;

template <typename T>
std::vector<T> Rand(int64_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(d(rng));
  return v;
}
template <typename T>
std::vector<T> Normal(int64_t n, uint64_t seed, double stddev = 1) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0, stddev);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(d(rng));
  return v;
}

}  // namespace ops_test
}  // namespace sg
