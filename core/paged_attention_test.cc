// Attention over page groups (core/paged_attention.h) on the device under test: the CPU, or, built with
// SG_CUDA_EMULATED (//core:paged_attention_emulated_test), the CPU emulation of the CUDA backend
// (kernels/cuda/emulation), where attention_merge and the offload ring's copy streams are the CUDA code's.
#include "core/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

#ifdef SG_CUDA_EMULATED
constexpr Device kDevice = Device::kCUDA;
#else
constexpr Device kDevice = Device::kCPU;
#endif

std::unique_ptr<TransformerModel> MakeModel(DType dtype, Device device) {
  TransformerConfig config = *TransformerPreset("tiny");
  config.num_layers = 3;
  auto model = CreateTransformer(config, dtype, device);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 5;
  init.stddev = 0.3;  // attention far from uniform
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);  // the same draws on every device
  return std::move(*model);
}

StrategyOptions Seco(int64_t group, bool offload) {
  StrategyOptions o;
  o.name = "seco";
  o.chunk = 4;
  o.page_size = 2;
  o.lm_chunk = 5;
  o.attention_group = group;
  o.offload = offload;
  return o;
}

// Loss and every gradient, copied to the host and widened to double.
struct Result {
  double loss = 0;
  std::vector<std::vector<double>> grads;
};
Result Gradients(Model& m, const StrategyOptions& o) {
  Trainer t(m, o, {});
  auto r = t.ComputeGradients(RaggedBatch(m.vocab_size(), 2024));
  EXPECT_TRUE(r.ok()) << r.status();
  Result out;
  if (r.ok()) out.loss = r->loss;
  for (Param& p : m.params()) {
    if (p.grad.dtype() == DType::kF64) {
      out.grads.push_back(HostCopy<double>(p.grad));
    } else {
      const std::vector<float> g = HostCopy<float>(p.grad);
      out.grads.emplace_back(g.begin(), g.end());
    }
  }
  return out;
}

void ExpectClose(const Result& got, const Result& want, double tol, const std::string& what) {
  EXPECT_NEAR(got.loss, want.loss, tol * std::abs(want.loss)) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    double scale = 1e-3, diff = 0;
    for (size_t j = 0; j < got.grads[i].size(); ++j) {
      scale = std::max(scale, std::abs(want.grads[i][j]));
      diff = std::max(diff, std::abs(got.grads[i][j] - want.grads[i][j]));
    }
    EXPECT_LE(diff, tol * scale) << what << ", parameter " << i;
  }
}

// Groups of one page (every group merged, dQ summed over the groups) against one group, which is one call.
TEST(PagedAttentionTest, GroupsOfOnePageMatchOneCall) {
  for (DType dtype : {DType::kF64, DType::kF32}) {
    auto model = MakeModel(dtype, kDevice);
    const double tol = dtype == DType::kF64 ? 1e-11 : 2e-5;
    ExpectClose(Gradients(*model, Seco(2, false)), Gradients(*model, Seco(0, false)), tol, DTypeName(dtype));
  }
}

// Dense offload streams the groups through the ring on the device's copy lanes: the same bits as without it.
TEST(PagedAttentionTest, StreamedGroupsAreBitIdentical) {
  for (DType dtype : {DType::kF64, DType::kF32, DType::kBF16}) {
    auto model = MakeModel(dtype, kDevice);
    for (int64_t group : {2, 6}) {
      const Result plain = Gradients(*model, Seco(group, false)), offloaded = Gradients(*model, Seco(group, true));
      EXPECT_EQ(offloaded.loss, plain.loss) << DTypeName(dtype) << " group " << group;
      EXPECT_EQ(offloaded.grads, plain.grads) << DTypeName(dtype) << " group " << group;
    }
  }
}

#ifdef SG_CUDA_EMULATED
// The device's grouped attention (its attention_merge included) against the CPU's.
TEST(PagedAttentionTest, DeviceMatchesCpu) {
  auto gpu = MakeModel(DType::kF64, Device::kCUDA), cpu = MakeModel(DType::kF64, Device::kCPU);
  for (bool offload : {false, true})
    ExpectClose(Gradients(*gpu, Seco(2, offload)), Gradients(*cpu, Seco(2, offload)), 1e-10,
                offload ? "offload, groups of 2" : "groups of 2");
}
#endif

}  // namespace
}  // namespace sg
