// Test helpers for checking analytic gradients against central finite differences (fp64).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "kernels/backend.h"

namespace sg::testing_fd {

using Vec = std::vector<double>;

inline Vec Random(size_t n, uint64_t seed, double scale = 1.0, double mean = 0.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(mean, scale);
  Vec v(n);
  for (double& x : v) x = d(rng);
  return v;
}

inline double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// max |a[i] - b[i]| (equal sizes).
inline double MaxDiff(const Vec& a, const Vec& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// max |a[i] - b[i]| relative to max |b[i]|: an f32 result against its f64 reference.
inline double RelErr(const std::vector<float>& a, const Vec& b) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    err = std::max(err, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return err / scale;
}

// Rows [from, from + count) of an array of `width` values per token: one chunk's part of a sequence's tensor.
inline Vec Rows(const Vec& v, int64_t from, int64_t count, int64_t width) {
  return Vec(v.begin() + from * width, v.begin() + (from + count) * width);
}

// a followed by b: two chunks' outputs as one sequence's.
inline Vec Concat(const Vec& a, const Vec& b) {
  Vec c = a;
  c.insert(c.end(), b.begin(), b.end());
  return c;
}

// Max error of the analytic gradient of f with respect to x against central differences, relative to the largest
// numeric entry.
inline double FiniteDifferenceError(const std::function<double()>& f, Vec& x, const Vec& analytic) {
  const double h = 1e-6;
  double max_err = 0, max_ref = 1e-12;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = f();
    x[i] = saved - h;
    const double down = f();
    x[i] = saved;
    const double numeric = (up - down) / (2 * h);
    max_err = std::max(max_err, std::abs(numeric - analytic[i]));
    max_ref = std::max(max_ref, std::abs(numeric));
  }
  return max_err / max_ref;
}

// A paged view of pools k, v (element type KV) for attention tests.
template <typename KV>
PagedKV<KV> PagedView(KV* k, KV* v, const std::vector<int32_t>& table, int64_t page_size, int64_t kv_heads,
                      int64_t head_dim) {
  PagedKV<KV> p;
  p.k_pool = k;
  p.v_pool = v;
  p.page_table = table.data();
  p.page_size = page_size;
  p.page_stride = page_size * kv_heads * head_dim;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  return p;
}

}  // namespace sg::testing_fd
