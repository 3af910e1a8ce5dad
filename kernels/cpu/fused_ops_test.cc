// The fused layer ops against the unfused sequences they replace, bit for bit: RoPE into the K/V page write
// (rope, then the page copy or rounding), RMSNorm and SwiGLU with their bf16 roundings (round_bf16 passes), and
// SwiGLU's backward over bf16 kept operands (bf16_to_f32, then swiglu_backward). Shapes both below and above the
// kernels' OpenMP thresholds, with odd lengths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

#include "kernels/backend.h"

namespace sg {
namespace {

template <typename T>
std::vector<T> Random(int64_t count, uint32_t seed, double scale = 3.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<T> v(count);
  for (T& x : v) x = static_cast<T>(normal(rng));
  return v;
}

template <typename A, typename B>
bool SameBits(const std::vector<A>& a, const std::vector<B>& b) {
  return a.size() * sizeof(A) == b.size() * sizeof(B) && std::memcmp(a.data(), b.data(), a.size() * sizeof(A)) == 0;
}

// A paged cache of `pages` logical pages in a pool of pages + 2, mapped in reverse, logical page 1 absent (-1).
// Pages are not copyable (the view points into them).
template <typename P>
struct Pages {
  Pages(int64_t pages, int64_t page_size, int64_t kv_heads, int64_t head_dim)
      : k((pages + 2) * page_size * kv_heads * head_dim, P(7)), v(k.size(), P(7)), table(pages) {
    for (int64_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(pages + 1 - i);
    table[1] = -1;
    view.k_pool = k.data();
    view.v_pool = v.data();
    view.page_table = table.data();
    view.page_size = page_size;
    view.page_stride = page_size * kv_heads * head_dim;
    view.kv_heads = kv_heads;
    view.head_dim = head_dim;
  }
  // Rows [pos0, pos0 + n) of dense k, v written page by page with `put` (the unfused PagePool::Scatter).
  template <typename T, typename Put>
  void Scatter(const std::vector<T>& dk, const std::vector<T>& dv, int64_t n, int64_t pos0, Put put) {
    const int64_t row = view.kv_heads * view.head_dim;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = pos0 + i;
      if (!view.has_page(t / view.page_size)) continue;
      const int64_t off = (t % view.page_size) * row;
      put(dk.data() + i * row, row, view.k_page(t / view.page_size) + off);
      put(dv.data() + i * row, row, view.v_page(t / view.page_size) + off);
    }
  }
  Pages(const Pages&) = delete;
  std::vector<P> k, v;
  std::vector<int32_t> table;
  PagedKV<P> view;
};

struct RopeShape {
  int64_t n, pos0, page_size, kv_heads, head_dim;
};
const RopeShape kRopeShapes[] = {{5, 3, 4, 2, 6}, {700, 37, 64, 2, 64}};

std::vector<double> InvFreq(int64_t head_dim) {
  std::vector<double> f(head_dim / 2);
  for (size_t i = 0; i < f.size(); ++i) f[i] = 1.0 / std::pow(10000.0, 2.0 * i / head_dim);
  return f;
}

template <typename T>
void CheckRopeKvWrite() {
  const OpTable<T>& ops = CpuOps<T>();
  for (const RopeShape& s : kRopeShapes) {
    const int64_t row = s.kv_heads * s.head_dim, pages = (s.pos0 + s.n + s.page_size - 1) / s.page_size;
    const std::vector<double> inv_freq = InvFreq(s.head_dim);
    const std::vector<T> k = Random<T>(s.n * row, 1), v = Random<T>(s.n * row, 2);
    Pages<T> fused(pages, s.page_size, s.kv_heads, s.head_dim), unfused(pages, s.page_size, s.kv_heads, s.head_dim);
    ops.rope_kv_write(k.data(), v.data(), s.n, s.pos0, inv_freq.data(), fused.view);
    std::vector<T> roped = k;
    ops.rope(roped.data(), s.n, s.kv_heads, s.head_dim, s.pos0, inv_freq.data(), false);
    unfused.Scatter(roped, v, s.n, s.pos0, [&](const T* src, int64_t count, T* dst) { ops.copy(dst, src, count); });
    EXPECT_TRUE(SameBits(fused.k, unfused.k)) << "K, n=" << s.n;
    EXPECT_TRUE(SameBits(fused.v, unfused.v)) << "V, n=" << s.n;
  }
}

TEST(FusedOpsTest, RopeKvWriteF32) { CheckRopeKvWrite<float>(); }
TEST(FusedOpsTest, RopeKvWriteF64) { CheckRopeKvWrite<double>(); }

TEST(FusedOpsTest, RopeKvWriteBF16) {
  const OpTable<float>& ops = CpuOps<float>();
  for (const RopeShape& s : kRopeShapes) {
    const int64_t row = s.kv_heads * s.head_dim, pages = (s.pos0 + s.n + s.page_size - 1) / s.page_size;
    const std::vector<double> inv_freq = InvFreq(s.head_dim);
    const std::vector<float> k = Random<float>(s.n * row, 3), v = Random<float>(s.n * row, 4);
    Pages<uint16_t> fused(pages, s.page_size, s.kv_heads, s.head_dim), unfused(pages, s.page_size, s.kv_heads, s.head_dim);
    ops.rope_kv_write_bf16(k.data(), v.data(), s.n, s.pos0, inv_freq.data(), fused.view);
    std::vector<float> roped = k;
    ops.rope(roped.data(), s.n, s.kv_heads, s.head_dim, s.pos0, inv_freq.data(), false);
    unfused.Scatter(roped, v, s.n, s.pos0,
                    [&](const float* src, int64_t count, uint16_t* dst) { ops.f32_to_bf16(src, count, dst); });
    EXPECT_TRUE(SameBits(fused.k, unfused.k)) << "K, n=" << s.n;
    EXPECT_TRUE(SameBits(fused.v, unfused.v)) << "V, n=" << s.n;
  }
}

TEST(FusedOpsTest, RmsNormForwardBF16) {
  const OpTable<float>& ops = CpuOps<float>();
  for (auto [n, d] : {std::pair<int64_t, int64_t>{3, 7}, {300, 257}}) {
    const std::vector<float> x = Random<float>(n * d, 5), w = Random<float>(d, 6, 1.0);
    std::vector<float> y(n * d), rstd(n), y_ref(n * d), rstd_ref(n), y_no_half(n * d), rstd_no_half(n);
    std::vector<uint16_t> half(n * d), half_ref(n * d);
    ops.rmsnorm_forward_bf16(x.data(), w.data(), n, d, 1e-5, y.data(), rstd.data(), half.data());
    ops.rmsnorm_forward_bf16(x.data(), w.data(), n, d, 1e-5, y_no_half.data(), rstd_no_half.data(), nullptr);
    ops.rmsnorm_forward(x.data(), w.data(), n, d, 1e-5, y_ref.data(), rstd_ref.data());
    ops.round_bf16(y_ref.data(), n * d, half_ref.data());
    EXPECT_TRUE(SameBits(y, y_ref)) << n << "x" << d;
    EXPECT_TRUE(SameBits(rstd, rstd_ref)) << n << "x" << d;
    EXPECT_TRUE(SameBits(half, half_ref)) << n << "x" << d;
    EXPECT_TRUE(SameBits(y_no_half, y_ref)) << n << "x" << d;
  }
}

TEST(FusedOpsTest, SwigluForwardBF16) {
  const OpTable<float>& ops = CpuOps<float>();
  for (int64_t count : {int64_t{13}, int64_t{70001}}) {
    std::vector<float> gate = Random<float>(count, 7), up = Random<float>(count, 8);
    // Values the rounding treats specially: NaN, infinities, signed zeros, ties (to even), subnormals, overflow.
    const float inf = std::numeric_limits<float>::infinity(), special[] = {
        std::numeric_limits<float>::quiet_NaN(), inf, -inf, 0.0f, -0.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256,
        -(1.0f + 1.0f / 256), 1e-40f, -1e-42f, 3.4e38f};
    for (size_t i = 0; i < std::size(special); ++i) gate[i] = special[i], up[std::size(special) - 1 - i] = special[i];
    std::vector<float> out(count), out_ref(count), out_no_half(count), g = gate, u = up;
    std::vector<uint16_t> gh(count), uh(count), oh(count), gh_ref(count), uh_ref(count), oh_ref(count);
    ops.swiglu_forward_bf16(gate.data(), up.data(), count, out.data(), gh.data(), uh.data(), oh.data());
    ops.swiglu_forward_bf16(gate.data(), up.data(), count, out_no_half.data(), nullptr, nullptr, nullptr);
    ops.round_bf16(g.data(), count, gh_ref.data());
    ops.round_bf16(u.data(), count, uh_ref.data());
    ops.swiglu_forward(g.data(), u.data(), count, out_ref.data());
    ops.round_bf16(out_ref.data(), count, oh_ref.data());
    EXPECT_TRUE(SameBits(out, out_ref)) << count;
    EXPECT_TRUE(SameBits(out_no_half, out_ref)) << count;
    EXPECT_TRUE(SameBits(gh, gh_ref) && SameBits(uh, uh_ref) && SameBits(oh, oh_ref)) << count;
  }
}

TEST(FusedOpsTest, SwigluBackwardBF16) {
  const OpTable<float>& ops = CpuOps<float>();
  for (int64_t count : {int64_t{13}, int64_t{70001}}) {
    const std::vector<float> dout = Random<float>(count, 9), gate = Random<float>(count, 10),
                             up = Random<float>(count, 11);
    std::vector<uint16_t> gh(count), uh(count);
    ops.f32_to_bf16(gate.data(), count, gh.data());
    ops.f32_to_bf16(up.data(), count, uh.data());
    std::vector<float> dg(count), du(count), dg_ref(count), du_ref(count), g(count), u(count);
    ops.swiglu_backward_bf16(dout.data(), gh.data(), uh.data(), count, dg.data(), du.data());
    ops.bf16_to_f32(gh.data(), count, g.data());
    ops.bf16_to_f32(uh.data(), count, u.data());
    ops.swiglu_backward(dout.data(), g.data(), u.data(), count, dg_ref.data(), du_ref.data());
    EXPECT_TRUE(SameBits(dg, dg_ref)) << count;
    EXPECT_TRUE(SameBits(du, du_ref)) << count;
  }
}

}  // namespace
}  // namespace sg
