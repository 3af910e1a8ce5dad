// A roofline census of the ops a run executes: a counting decorator over a device's op table records, for every
// call, its kernel family, its matmul FLOPs and the bytes it must read and write (each operand once, at its storage
// dtype), computed from the call's arguments alone, then forwards to the wrapped table. Over the meta table
// (kernels/meta: shapes, no storage, nothing executed) a step at 128K tokens is counted in seconds; over the CPU
// table the same step executes and must give the same records (core/census_test.cc).
//
// The records model the CUDA backend's kernels (kernels/cuda), whatever table is wrapped:
// - FLOPs are tensor-core (matmul) FLOPs: GEMMs 2mnk; attention 2 x head_dim per (query, key, head) and product,
//   over the causal pairs of the selected pages, with the products the CUDA kernels compute per pair: forward
//   S = QK^T and PV (2); backward a dQ pass (S, dP, dQ: 3) and, for keys whose gradient page exists, a dK/dV pass
//   (S, dP, dV, dK: 4); the gated delta rule and Mamba-2's SSD scan their state products (census.cc). Every other
//   op counts 0 FLOPs: its arithmetic is far below its memory time.
// - bytes are compulsory traffic: every input read once, every output written once, accumulated outputs read and
//   written. gemm_mixed with an f32 operand adds the rounding pass the CUDA backend runs first (family
//   "bf16_round": f32 read, bf16 written), and its GEMM reads that operand as bf16.
// Host-side loops (gradient norms, clipping, page scores) and KV-offload copies are not table ops and not counted.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/backend.h"

namespace sg {

enum class OpFamily {
  kGemm,               // gemm, gemm_mixed's product
  kBf16Round,          // gemm_mixed: an f32 operand rounded into bf16 scratch (CUDA)
  kAttentionForward,
  kAttentionBackward,
  kNorm,               // rmsnorm forward / backward, Mamba-2's gated group rmsnorm
  kRope,
  kPointwise,          // swiglu, silu, softplus, sigmoid gate, bias, add, copy, copy_rows, fill, scale; the
                       // mixture-of-experts router and its row gathers, scatters and dots
  kEmbedding,
  kConvert,            // bf16 <-> f32
  kLoss,               // cross-entropy, token log-probs, arg max over the vocabulary
  kSsm,                // conv1d, selective scan, Gated DeltaNet's gates and delta rule, Mamba-2's SSD scan
  kOptimizer,          // adamw
};
constexpr int kNumOpFamilies = 12;
const char* OpFamilyName(OpFamily f);

struct OpRecord {
  const char* op = "";  // the OpTable entry
  OpFamily family = OpFamily::kPointwise;
  int64_t flops = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  bool operator==(const OpRecord& o) const {
    return std::string_view(op) == o.op && family == o.family && flops == o.flops && bytes_read == o.bytes_read &&
           bytes_written == o.bytes_written;
  }
};

// A device's limits: the roofline time of an op is max(flops / peak_flops, bytes / bandwidth).
struct RooflineLimits {
  double peak_flops = 989e12;  // H100 SXM, dense bf16 tensor cores
  double bandwidth = 3.35e12;  // H100 SXM HBM3, bytes/s
  double Seconds(const OpRecord& r) const;
  bool ComputeBound(const OpRecord& r) const;
};

struct FamilyTotals {
  int64_t calls = 0;
  int64_t flops = 0;
  int64_t bytes = 0;            // read + written
  double seconds = 0;           // sum of the ops' roofline times
  double compute_seconds = 0;   // the part of `seconds` from compute-bound ops
};

// The records of the counted calls, summed per family (and kept one by one when asked).
class OpCensus {
 public:
  OpCensus() = default;
  explicit OpCensus(RooflineLimits limits, bool keep_records = false)
      : limits_(limits), keep_(keep_records) {}
  void Add(const OpRecord& r);
  void Clear();
  const RooflineLimits& limits() const { return limits_; }
  const std::vector<OpRecord>& records() const { return records_; }
  const FamilyTotals& family(OpFamily f) const { return families_[static_cast<int>(f)]; }
  FamilyTotals Total() const;

 private:
  RooflineLimits limits_;
  bool keep_ = false;
  std::vector<OpRecord> records_;
  std::array<FamilyTotals, kNumOpFamilies> families_{};
};

// While alive, device d's registered backend is replaced by one whose op tables count every call into `census`
// and forward it to the tables registered before; restored when it ends. Tables looked up (OpsFor) during its life,
// models created in it included, must not outlive it. One at a time per process (a second throws).
class CensusScope {
 public:
  CensusScope(Device d, OpCensus* census);
  ~CensusScope();
  CensusScope(const CensusScope&) = delete;
  CensusScope& operator=(const CensusScope&) = delete;

 private:
  Device device_;
  DeviceBackend previous_;
};

// (query, key) pairs of a causal attention call over the keys [key_begin, pos0 + n) of the logical pages with
// keep(page): query at position p sees the keys key_begin <= j <= p. Exposed for tests.
template <typename Keep>
int64_t CausalPairs(const AttentionShape& s, int64_t page_size, Keep keep) {
  int64_t pairs = 0;
  const int64_t end = s.pos0 + s.n;
  for (int64_t p = s.key_begin / page_size; p * page_size < end; ++p) {
    if (!keep(p)) continue;
    const int64_t j0 = std::max(p * page_size, s.key_begin), j1 = std::min(end, (p + 1) * page_size);
    // key j is seen by the queries [max(j, pos0), end): end - max(j, pos0) of them
    const int64_t below = std::max<int64_t>(0, std::min(j1, s.pos0) - j0);  // keys before pos0: n queries each
    pairs += below * s.n;
    const int64_t a = std::max(j0, s.pos0), b = j1;  // keys in [pos0, end): end - j queries each
    if (b > a) pairs += (b - a) * end - (b - a) * (a + b - 1) / 2;
  }
  return pairs;
}

}  // namespace sg
