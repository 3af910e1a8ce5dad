// Times the CPU attention kernels alone on bench-cpu's attention shape (4 heads, 2 KV heads, head_dim 64, pages
// of 256), f32 and bf16 pages: what kernels/cpu/attention.cc's blocking is tuned with.
//   ./bazelw run -c opt //kernels/cpu:attention_bench -- [n] [repeats] [matmul: fp32 (default) or bf16]
#include <omp.h>

#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {
namespace {

template <typename KV>
void Run(int64_t n, int repeats, const char* label) {
  AttentionShape s;
  s.n = n;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 64;
  s.scale = 0.125;
  const int64_t ps = 256, pages = (n + ps - 1) / ps, stride = ps * s.kv_heads * s.head_dim;
  const int64_t qn = n * s.heads * s.head_dim;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto fill = [&](auto& v) {
    for (auto& x : v) {
      const float f = normal(rng);
      if constexpr (sizeof(x) == 2) x = F32ToBF16(f);
      else x = f;
    }
  };
  std::vector<KV> k(pages * stride), v(pages * stride), dk(pages * stride), dv(pages * stride);
  std::vector<float> q(qn), dout(qn), out(qn), dq(qn), lse(n * s.heads);
  fill(k);
  fill(v);
  fill(q);
  fill(dout);
  std::vector<int32_t> table(pages);
  for (int64_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(i);
  auto view = [&](std::vector<KV>& kk, std::vector<KV>& vv) {
    PagedKV<KV> p;
    p.k_pool = kk.data();
    p.v_pool = vv.data();
    p.page_table = table.data();
    p.page_size = ps;
    p.page_stride = stride;
    p.kv_heads = s.kv_heads;
    p.head_dim = s.head_dim;
    return p;
  };
  std::vector<float> ws(AttentionWorkspaceElems(s, ps));
  // causal QK^T and PV: 2 products of n^2/2 x head_dim multiply-adds per head; backward has 5 such products
  const double fwd_flop = 2.0 * 2 * (0.5 * n * n) * s.head_dim * s.heads;
  // The least of the repeats, by wall time and by CPU time (all threads: on a shared machine the steadier one).
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
  };
  double tf = 1e30, tb = 1e30, cf = 1e30, cb = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const double c0 = cpu_now();
    auto t0 = std::chrono::steady_clock::now();
    AttentionForward<float, KV>(s, q.data(), view(k, v), out.data(), lse.data(), ws.data());
    const double c1 = cpu_now();
    auto t1 = std::chrono::steady_clock::now();
    AttentionBackward<float, KV>(s, q.data(), view(k, v), out.data(), lse.data(), dout.data(), dq.data(),
                                 view(dk, dv), ws.data());
    const double c2 = cpu_now();
    auto t2 = std::chrono::steady_clock::now();
    tf = std::min(tf, std::chrono::duration<double>(t1 - t0).count());
    tb = std::min(tb, std::chrono::duration<double>(t2 - t1).count());
    cf = std::min(cf, c1 - c0);
    cb = std::min(cb, c2 - c1);
  }
  double check = 0;
  for (int64_t i = 0; i < qn; i += 97) check += out[i] + dq[i];
  std::printf("%-5s n=%6lld threads=%d  forward %.4f s (cpu %.4f s, %.1f GFLOP/cpu-s)  backward %.4f s (cpu %.4f s, "
              "%.1f GFLOP/cpu-s)  check %.6g\n",
              label, static_cast<long long>(n), omp_get_max_threads(), tf, cf, fwd_flop / cf * 1e-9, tb, cb,
              2.5 * fwd_flop / cb * 1e-9, check);
}

}  // namespace
}  // namespace sg::cpu

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  if (argc > 3) {
    if (const std::string refused = sg::cpu::SetMatmul(argv[3]); !refused.empty()) {
      std::fprintf(stderr, "error: matmul argument: %s\n", refused.c_str());
      return 2;
    }
    std::printf("matmul=%s\n", argv[3]);
  }
  sg::cpu::Run<float>(n, repeats, "f32");
  sg::cpu::Run<uint16_t>(n, repeats, "bf16");
}
