// The meta device's plan of a training step against the same step measured on the CPU: every category's peak,
// the total's peak and the host bytes of offload must be equal, for every strategy, both families, LoRA, offload,
// sparse pages and the dpo/grpo objectives.
#include "core/plan.h"

#include <sys/resource.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace sg {
namespace {

struct Case {
  std::string model;
  std::string strategy;
  int64_t seq_len = 96;
  int64_t chunk = 32;
  int64_t lora_rank = 0;
  double lora_dropout = 0;
  bool offload = false;
  bool offload_experts = false;
  int64_t sparse_pages = 0;
  int64_t attention_group = 0;  // tokens (StrategyOptions::attention_group)
  std::string objective = "sft";
  std::string adjoint_form = "pairs";
  DType dtype = DType::kF32;
};

std::string Name(const Case& c) {
  return absl::StrCat(c.model, "/", c.strategy, " T=", c.seq_len, " chunk=", c.chunk, " lora=", c.lora_rank,
                      c.lora_dropout > 0 ? "+dropout" : "", c.offload ? " offload" : "",
                      c.offload_experts ? " offload_experts" : "", " sparse=", c.sparse_pages,
                      c.attention_group > 0 ? absl::StrCat(" group=", c.attention_group) : "", " ", c.objective, " ",
                      DTypeName(c.dtype));
}

MemoryPlan Plan(const Case& c, Device device) {
  LoraOptions lora;
  lora.rank = c.lora_rank;
  lora.alpha = 2.0 * c.lora_rank;
  lora.dropout = c.lora_dropout;
  if (c.model == "tiny-ssm") lora.targets = {"in_proj", "x_proj"};  // what PEFT accepts on Mamba
  if (c.model == "tiny-mamba2" || c.model == "tiny-bamba" || c.model == "tiny-nemotron-h")
    lora.targets = {"in_proj", "q_proj", "v_proj"};  // the Mamba-2 mixers' and the hybrids' attention
  absl::StatusOr<std::unique_ptr<Model>> m = CreatePlanModel(c.model, c.dtype, device, lora, 7);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  StrategyOptions s;
  s.name = c.strategy;
  s.chunk = c.chunk;
  s.page_size = 16;
  s.lm_chunk = 24;
  s.offload = c.offload;
  s.offload_experts = c.offload_experts;
  s.sparse_pages = c.sparse_pages;
  s.attention_group = c.attention_group;
  s.spaco_budget = 2;
  s.adjoint_form = c.adjoint_form;
  ObjectiveOptions o;
  o.name = c.objective;
  absl::StatusOr<MemoryPlan> p = PlanStep(**m, s, o, c.seq_len);
  EXPECT_TRUE(p.ok()) << Name(c) << ": " << p.status();
  return p.ok() ? *p : MemoryPlan{};
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const char* model : {"tiny", "tiny-qwen2", "tiny-qwen3.5", "demo"})
    for (const char* strategy : {"full", "ckpt", "seco", "spaco", "streambp"}) {
      Case c;
      c.model = model;
      c.strategy = strategy;
      cases.push_back(c);
      c.lora_rank = 2;
      cases.push_back(c);
    }
  for (const char* model : {"tiny-mamba2", "tiny-bamba", "tiny-nemotron-h", "tiny-falcon-h1"}) {
    for (const char* strategy : {"full", "ckpt", "seco", "spaco", "streambp"}) cases.push_back(Case{model, strategy});
    // LoRA in bf16 (the plan tables' runs), without and with offload.
    for (bool offload : {false, true}) {
      Case c{model, "seco"};
      c.seq_len = 256;
      c.lora_rank = 2;
      c.dtype = DType::kBF16;
      c.offload = offload;
      cases.push_back(c);
    }
  }
  for (const char* strategy : {"full", "ckpt", "seco", "spaco", "adjoint"}) {
    Case c;
    c.model = "tiny-ssm";
    c.strategy = strategy;
    cases.push_back(c);
    c.lora_rank = 2;
    cases.push_back(c);
  }
  Case scan{"tiny-ssm", "adjoint"};
  scan.adjoint_form = "scan";
  cases.push_back(scan);
  // LoRA dropout (its masks are host loops that meta skips), f64, offload, sparse pages, both together.
  Case dropout{"tiny", "seco"};
  dropout.lora_rank = 4;
  dropout.lora_dropout = 0.1;
  cases.push_back(dropout);
  Case f64{"tiny", "seco"};
  f64.dtype = DType::kF64;
  cases.push_back(f64);
  Case sparse{"tiny", "seco"};
  sparse.seq_len = 256;
  sparse.chunk = 32;
  sparse.sparse_pages = 2;
  cases.push_back(sparse);
  sparse.strategy = "full";
  cases.push_back(sparse);
  for (bool with_sparse : {false, true}) {
    Case off{"tiny", "seco"};
    off.seq_len = 256;
    off.offload = true;
    off.sparse_pages = with_sparse ? 2 : 0;
    cases.push_back(off);
    off.lora_rank = 2;
    cases.push_back(off);
  }
  // bf16 storage (weights, KV pages, logits; fp32 masters under master_weights), with LoRA over a frozen bf16 base
  // and with offloaded sparse pages; Mamba's bf16 matrices under every strategy.
  for (const char* strategy : {"full", "seco", "streambp"}) {
    Case bf16{"tiny", strategy};
    bf16.dtype = DType::kBF16;
    cases.push_back(bf16);
    bf16.lora_rank = 2;
    cases.push_back(bf16);
  }
  for (const char* strategy : {"full", "seco", "streambp", "adjoint"}) {
    Case bf16{"tiny-ssm", strategy};
    bf16.dtype = DType::kBF16;
    cases.push_back(bf16);
    bf16.lora_rank = 2;
    cases.push_back(bf16);
  }
  // The Qwen3.5 hybrid in bf16, and offloading the pages of its attention layers.
  for (const char* strategy : {"full", "seco", "streambp"}) {
    Case bf16{"tiny-qwen3.5", strategy};
    bf16.dtype = DType::kBF16;
    cases.push_back(bf16);
  }
  Case hybrid_offload{"tiny-qwen3.5", "seco"};
  hybrid_offload.seq_len = 256;
  hybrid_offload.offload = true;
  cases.push_back(hybrid_offload);
  Case bf16_offload{"tiny", "seco"};
  bf16_offload.dtype = DType::kBF16;
  bf16_offload.seq_len = 256;
  bf16_offload.offload = true;
  bf16_offload.sparse_pages = 2;
  cases.push_back(bf16_offload);
  // Attention in page groups of 2 pages: dense offload streams them through the ring; without offload only the
  // groups' merge buffers are added.
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (bool offload : {true, false}) {
      Case grouped{"tiny", "seco"};
      grouped.dtype = dtype;
      grouped.seq_len = 256;
      grouped.offload = offload;
      grouped.attention_group = 32;
      cases.push_back(grouped);
      grouped.lora_rank = 2;
      cases.push_back(grouped);
    }
  for (const char* objective : {"dpo", "grpo"})
    for (const char* strategy : {"seco", "full"}) {
      Case c{"tiny", strategy};
      c.objective = objective;
      cases.push_back(c);
    }
  return cases;
}

TEST(PlanTest, MetaPlanEqualsCpuPeakPerCategory) {
  for (const Case& c : Cases()) {
    const MemoryPlan cpu = Plan(c, Device::kCPU), meta = Plan(c, Device::kMeta);
    ASSERT_GT(cpu.device.total_peak, 0) << Name(c);
    for (int i = 0; i < kNumMemCategories; ++i) {
      EXPECT_EQ(meta.device.peak[i], cpu.device.peak[i])
          << Name(c) << ": " << MemCategoryName(static_cast<MemCategory>(i));
      EXPECT_EQ(meta.device.at_total_peak[i], cpu.device.at_total_peak[i])
          << Name(c) << ": at the total's peak, " << MemCategoryName(static_cast<MemCategory>(i));
    }
    EXPECT_EQ(meta.device.total_peak, cpu.device.total_peak) << Name(c);
    EXPECT_EQ(meta.host_bytes, cpu.host_bytes) << Name(c);
    if (c.offload) {
      EXPECT_GT(meta.host_bytes, 0) << Name(c);
    }
  }
}

// Mixtures of experts: how many tokens each expert takes is known only once the router ran, so the plan takes the
// largest groups (the first top_k experts take every token): the workspace, where the groups' GEMM buffers live,
// and the total are bounds of the measured peaks; every other category is exact, and so are the host bytes of
// expert offload (LoRA's frozen experts; with KV offload too under seco).
TEST(PlanTest, MixtureOfExpertsPlanBoundsTheCpuPeak) {
  for (const char* model : {"tiny-qwen3-moe", "tiny-qwen3-next"})
    for (const char* strategy : {"full", "seco", "streambp"})
      for (int variant = 0; variant < 4; ++variant) {
        Case c{model, strategy};
        c.lora_rank = variant > 0 ? 2 : 0;
        c.offload_experts = variant > 1;
        c.offload = variant > 2 && c.strategy == "seco";
        const MemoryPlan cpu = Plan(c, Device::kCPU), meta = Plan(c, Device::kMeta);
        EXPECT_EQ(meta.host_bytes, cpu.host_bytes) << Name(c);
        if (c.offload_experts) {
          EXPECT_GT(meta.host_bytes, 0) << Name(c);
        }
        ASSERT_GT(cpu.device.total_peak, 0) << Name(c);
        for (int i = 0; i < kNumMemCategories; ++i) {
          const MemCategory category = static_cast<MemCategory>(i);
          if (category == MemCategory::kWorkspace)
            EXPECT_GE(meta.device.peak[i], cpu.device.peak[i]) << Name(c) << ": workspace";
          else
            EXPECT_EQ(meta.device.peak[i], cpu.device.peak[i]) << Name(c) << ": " << MemCategoryName(category);
        }
        EXPECT_GE(meta.device.total_peak, cpu.device.total_peak) << Name(c);
      }
}

// A plan is not a constant: longer sequences, LoRA and offload change it the way they must.
TEST(PlanTest, PlansRespondToTheirOptions) {
  Case c{"tiny", "seco"};
  const MemoryPlan base = Plan(c, Device::kMeta);
  c.seq_len = 2 * base.seq_len;
  const MemoryPlan longer = Plan(c, Device::kMeta);
  EXPECT_EQ(longer.device.peak[static_cast<int>(MemCategory::kKVCache)],
            2 * base.device.peak[static_cast<int>(MemCategory::kKVCache)]);
  c.lora_rank = 2;
  const MemoryPlan lora = Plan(c, Device::kMeta);
  EXPECT_LT(lora.device.peak[static_cast<int>(MemCategory::kOptimizer)],
            longer.device.peak[static_cast<int>(MemCategory::kOptimizer)]);
}

// Expert offload: the device's weights lose every MoE layer's experts but two slots' worth (tiny-qwen3-next: four
// MoE layers, each 4 experts of gate_up [32][32] and down [32][16] in f32), which the host holds.
TEST(PlanTest, ExpertOffloadKeepsTwoLayersOfExperts) {
  Case c{"tiny-qwen3-next", "seco"};
  c.lora_rank = 2;
  const MemoryPlan resident = Plan(c, Device::kMeta);
  c.offload_experts = true;
  const MemoryPlan offloaded = Plan(c, Device::kMeta);
  const int64_t layer = 4 * (32 * 32 + 32 * 16) * 4, weights = static_cast<int>(MemCategory::kWeights);
  EXPECT_EQ(offloaded.device.peak[weights], resident.device.peak[weights] - 4 * layer + 2 * layer);
  EXPECT_EQ(offloaded.host_bytes, resident.host_bytes + 4 * layer);
}

// Dense offload: the device's KV cache and KV gradient do not grow with T (the chunk's pages per resident layer and
// the ring of page groups), while the host's pages do.
TEST(PlanTest, DenseOffloadIsFlatInT) {
  Case c{"tiny", "seco"};
  c.offload = true;
  c.attention_group = 64;
  c.seq_len = 256;
  const MemoryPlan short_plan = Plan(c, Device::kMeta);
  c.seq_len = 1024;
  const MemoryPlan long_plan = Plan(c, Device::kMeta);
  for (MemCategory cat : {MemCategory::kKVCache, MemCategory::kKVGrad})
    EXPECT_EQ(long_plan.device.peak[static_cast<int>(cat)], short_plan.device.peak[static_cast<int>(cat)])
        << MemCategoryName(cat);
  EXPECT_EQ(long_plan.host_bytes, 4 * short_plan.host_bytes);
}

// The twin that --memory_budget and the memory check before training plan on has the model's storage: a bf16
// model's twin plans bf16 weights and fp32 masters, not an f32 model.
TEST(PlanTest, MetaTwinKeepsBF16Storage) {
  for (const char* preset : {"tiny", "tiny-ssm"}) {
    absl::StatusOr<std::unique_ptr<Model>> m = CreatePlanModel(preset, DType::kBF16, Device::kCPU, {}, 3);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(CreatedDType(**m), DType::kBF16);
    absl::StatusOr<std::unique_ptr<Model>> twin = MetaTwin(**m);
    ASSERT_TRUE(twin.ok()) << twin.status();
    EXPECT_EQ(CreatedDType(**twin), DType::kBF16) << preset;
    const MemorySnapshot a = (*m)->memory().Snapshot(), b = (*twin)->memory().Snapshot();
    EXPECT_EQ(a.current, b.current) << preset;
    StrategyOptions s;
    s.name = "seco";
    s.chunk = 16;
    absl::StatusOr<MemoryPlan> p = PlanStep(**twin, s, ObjectiveOptions{}, 64);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_GT(p->device.peak[static_cast<int>(MemCategory::kMasterWeights)], 0) << preset;
  }
}

// Packed documents walk the same schedule (attention in pieces inside each document): on meta, with sparse
// attention and offload too, the same bytes as one document but for attention's per-piece temporaries.
TEST(PlanTest, PackedDocumentsPlanLikeOneDocument) {
  absl::StatusOr<std::unique_ptr<Model>> m = CreatePlanModel("demo", DType::kF32, Device::kMeta, LoraOptions{}, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  StrategyOptions s;
  s.name = "seco";
  s.chunk = 256;
  s.page_size = 64;
  for (bool sparse_offload : {false, true}) {
    s.sparse_pages = sparse_offload ? 2 : 0;
    s.offload = sparse_offload;
    absl::StatusOr<MemoryPlan> one = PlanStep(**m, s, ObjectiveOptions{}, 4096);
    absl::StatusOr<MemoryPlan> docs = PlanStep(**m, s, ObjectiveOptions{}, 4096, /*limit=*/0, /*doc_len=*/700);
    ASSERT_TRUE(one.ok() && docs.ok()) << one.status() << docs.status();
    EXPECT_LE(docs->device.total_peak, one->device.total_peak + 64 * 1024) << sparse_offload;
    EXPECT_GE(docs->device.total_peak, one->device.total_peak) << sparse_offload;
  }
  EXPECT_FALSE(PlanStep(**m, s, ObjectiveOptions{}, 4096, 0, -1).ok());
}

// Meta allocates nothing: Qwen2.5-7B at 128K tokens with LoRA (a plan of hundreds of GB) runs here in a few
// seconds, and the process grows by far less than one layer's weights.
TEST(PlanTest, MetaWalksA7BModelAt128KWithoutMemory) {
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  LoraOptions lora;
  lora.rank = 16;
  absl::StatusOr<std::unique_ptr<Model>> m = CreatePlanModel("qwen2.5-7b", DType::kF32, Device::kMeta, lora, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  StrategyOptions s;
  s.name = "seco";
  s.chunk = 4096;
  absl::StatusOr<MemoryPlan> p = PlanStep(**m, s, ObjectiveOptions{}, 131072);
  ASSERT_TRUE(p.ok()) << p.status();
  // 7.6e9 parameters in f32, and 28 layers x 128K tokens x 2 x 512 x 4 bytes of KV cache.
  EXPECT_GT(p->device.peak[static_cast<int>(MemCategory::kWeights)], int64_t{30'000'000'000});
  EXPECT_LT(p->device.peak[static_cast<int>(MemCategory::kWeights)], int64_t{31'000'000'000});
  EXPECT_EQ(p->device.peak[static_cast<int>(MemCategory::kKVCache)], int64_t{28} * 131072 * 2 * 512 * 4);
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 256 * 1024) << "KiB of resident memory grew";
}

TEST(PlanTest, OverflowingSequenceIsRefusedByName) {
  absl::StatusOr<std::unique_ptr<Model>> m = CreatePlanModel("qwen2.5-7b", DType::kF32, Device::kMeta, {}, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  StrategyOptions s;
  s.name = "seco";
  absl::StatusOr<MemoryPlan> p = PlanStep(**m, s, ObjectiveOptions{}, int64_t{1} << 60);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("--seq_len=1152921504606846976"), std::string::npos) << p.status();
  EXPECT_NE(p.status().message().find("overflow 64 bits"), std::string::npos) << p.status();
}

// The longest fit fits, one more token does not (or is the cap).
TEST(PlanTest, LongestFitIsExactToOneToken) {
  absl::StatusOr<std::unique_ptr<Model>> m = CreatePlanModel("demo", DType::kF32, Device::kMeta, {}, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  StrategyOptions s;
  s.name = "full";
  s.page_size = 16;
  const int64_t memory = 40 << 20;
  absl::StatusOr<MemoryPlan> best = LongestFit(**m, s, ObjectiveOptions{}, memory, int64_t{1} << 40);
  ASSERT_TRUE(best.ok()) << best.status();
  EXPECT_LE(best->device.total_peak, memory);
  absl::StatusOr<MemoryPlan> next = PlanStep(**m, s, ObjectiveOptions{}, best->seq_len + 1);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_GT(next->device.total_peak, memory) << "at " << best->seq_len + 1;
  absl::StatusOr<MemoryPlan> none = LongestFit(**m, s, ObjectiveOptions{}, 1 << 10, int64_t{1} << 40);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
}

}  // namespace
}  // namespace sg
