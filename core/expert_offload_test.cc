// Expert weight offload (StrategyOptions::offload_experts, core/expert_offload.h) on the CPU backend: the ring on
// its own against a copy engine that copies only when a lane is waited for, then LoRA training steps with the
// experts offloaded against the same steps without, under every transformer strategy (and with KV offload too).
#include "core/expert_offload.h"

#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <ostream>

#include "core/lora.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

// Copies run only when their lane is waited for: a missing wait shows up as stale slot bytes.
struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};
std::deque<Copy> g_lane;

CopyEngine LazyCopyEngine() {
  CopyEngine e;
  e.alloc_host = [](size_t bytes) -> void* { return new char[bytes]; };
  e.free_host = [](void* p) { delete[] static_cast<char*>(p); };
  e.copy_async = [](void* dst, const void* src, size_t bytes, int lane) {
    ASSERT_EQ(lane, ExpertOffload::kLane);
    g_lane.push_back({dst, src, bytes});
  };
  e.wait = [](int) {
    for (const Copy& c : g_lane) std::memcpy(c.dst, c.src, c.bytes);
    g_lane.clear();
  };
  return e;
}

// Four layers of two weights (3 and 2 doubles), each element its layer * 10 + weight: every visit reads its own
// layer's bytes; the next layer's fetch is issued (not waited for) behind it; two slots are all the device holds.
TEST(ExpertOffloadTest, VisitsReadTheirLayerAndPrefetchTheNext) {
  MemoryTracker mem;
  std::vector<std::vector<Tensor>> layers;
  for (int l = 0; l < 4; ++l) {
    std::vector<Tensor>& weights = layers.emplace_back();
    for (int i = 0; i < 2; ++i) {
      weights.push_back(Tensor::Empty(&mem, MemCategory::kWeights, DType::kF64, {3 - i}));
      for (int64_t k = 0; k < 3 - i; ++k) weights.back().data<double>()[k] = l * 10 + i;
    }
  }
  ExpertOffload offload(mem, LazyCopyEngine());
  for (const std::vector<Tensor>& weights : layers) offload.AddLayer(weights);
  layers.clear();  // the device copies go: the slots, made at the first visit, remain
  EXPECT_EQ(mem.Snapshot().current[static_cast<int>(MemCategory::kWeights)], 0);
  offload.Visit(0, -1);
  EXPECT_EQ(mem.Snapshot().current[static_cast<int>(MemCategory::kWeights)], 2 * 5 * 8);
  EXPECT_EQ(offload.host_bytes(), 4 * 5 * 8);
  EXPECT_EQ(offload.home(2, 1).data<double>()[1], 21);
  // Forward then backward, as full backprop visits them (a layer visited twice in a row, a next layer already
  // resident), then a visit that was not prefetched.
  struct Visit {
    int layer, next;
    size_t prefetched;  // copies issued behind the visit
  };
  for (const Visit& t : {Visit{0, 1, 2}, Visit{1, 2, 2}, Visit{2, 3, 2}, Visit{3, 3, 0}, Visit{3, 2, 0}, Visit{2, 1, 2},
                         Visit{1, 0, 2}, Visit{0, -1, 0}, Visit{3, -1, 0}}) {
    const std::vector<WeightView> v = offload.Visit(t.layer, t.next);
    for (int i = 0; i < 2; ++i)
      for (int64_t k = 0; k < 3 - i; ++k)
        ASSERT_EQ(static_cast<const double*>(v[i].data)[k], t.layer * 10 + i) << t.layer << " " << i << " " << k;
    EXPECT_EQ(g_lane.size(), t.prefetched) << "the prefetch of " << t.next;
  }
  EXPECT_EQ(offload.fetched_bytes(), 7 * 5 * 8);  // each layer once a direction, and the last visit's miss
}

// created_offloaded: the experts made in host memory at creation (CreateTransformer's offload_experts).
std::unique_ptr<TransformerModel> Moe(const std::string& preset, DType dtype, bool frozen_base = true,
                                      bool created_offloaded = false) {
  auto model = CreateTransformer(*TransformerPreset(preset), dtype, Device::kCPU, {}, frozen_base, created_offloaded);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 7;
  init.stddev = 0.3;
  InitRandom(**model, init);
  if (frozen_base) {
    LoraOptions lora;
    lora.rank = 2;
    lora.targets = {"q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"};
    lora.seed = 3;
    EXPECT_TRUE(EnableLora(**model, lora).ok());
    RandomizeLoraB(**model, 11, 0.2);
  }
  return std::move(*model);
}

StrategyOptions Options(const std::string& name, bool offload_experts, bool kv_offload = false) {
  StrategyOptions o;
  o.name = name;
  o.chunk = name == "streambp" ? 7 : 5;
  o.page_size = 2;
  o.lm_chunk = 5;
  o.spaco_budget = 1;
  o.seed = 5;
  o.offload = kv_offload;
  o.offload_experts = offload_experts;
  return o;
}

// Every parameter's value and gradient as bytes (the adapters'; the frozen base has no gradient).
std::vector<std::vector<char>> Bytes(Model& m) {
  std::vector<std::vector<char>> out;
  for (Param& p : m.params())
    for (const Tensor* t : {&p.value, &p.grad}) {
      std::vector<char>& b = out.emplace_back(t->defined() ? t->nbytes() : 0);
      if (t->defined()) CopyToHost(*t, b.data());
    }
  return out;
}

struct Case {
  std::string preset;
  DType dtype;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.preset << " " << DTypeName(c.dtype); }

class ExpertOffloadStepTest : public ::testing::TestWithParam<Case> {};

// Two optimizer steps and a third gradient pass: every loss, adapter value and gradient byte is the run's without
// offload, under every strategy; the device then holds two layers' expert weights, not every layer's.
TEST_P(ExpertOffloadStepTest, BitIdenticalToResidentExperts) {
  const Case& c = GetParam();
  const std::vector<Sequence> batch = RaggedBatch(97, 12345);
  std::vector<StrategyOptions> runs;
  for (const char* name : {"full", "ckpt", "seco", "streambp", "spaco"}) runs.push_back(Options(name, true));
  runs.push_back(Options("seco", true, /*kv_offload=*/true));
  for (const StrategyOptions& o : runs) {
    SCOPED_TRACE(o.name + (o.offload ? " + KV offload" : ""));
    auto resident = Moe(c.preset, c.dtype), offloaded = Moe(c.preset, c.dtype);
    StrategyOptions plain = o;
    plain.offload_experts = false;
    Trainer a(*resident, plain, {}), b(*offloaded, o, {});
    int64_t expert_bytes = 0, moe_layers = 0;
    for (const Param& p : resident->params())
      if (p.name.find("mlp.experts.") != std::string::npos && p.name.find("lora") == std::string::npos) {
        expert_bytes += static_cast<int64_t>(p.value.nbytes());
        moe_layers += p.name.find("gate_up") != std::string::npos;
      }
    ASSERT_GT(moe_layers, 0);
    const int64_t layer_bytes = expert_bytes / moe_layers;
    auto weights = [](Model& m) { return m.memory().Snapshot().peak[static_cast<int>(MemCategory::kWeights)]; };
    resident->memory().ResetPeak();
    offloaded->memory().ResetPeak();
    for (int step = 0; step < 3; ++step) {
      auto x = step < 2 ? a.Step(batch) : a.ComputeGradients(batch);
      auto y = step < 2 ? b.Step(batch) : b.ComputeGradients(batch);
      ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
      EXPECT_EQ(x->loss, y->loss) << "step " << step;
      EXPECT_EQ(y->offloaded_bytes - x->offloaded_bytes, expert_bytes);
    }
    EXPECT_TRUE(Bytes(*resident) == Bytes(*offloaded));
    // Two slots (each a layer's gate_up and down) instead of every MoE layer's experts.
    EXPECT_EQ(weights(*offloaded), weights(*resident) - expert_bytes + std::min<int64_t>(2, moe_layers) * layer_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Exact, ExpertOffloadStepTest,
                         ::testing::Values(Case{"tiny-qwen3-moe", DType::kF64}, Case{"tiny-qwen3-next", DType::kF64},
                                           Case{"tiny-qwen3-next", DType::kBF16}),
                         [](const auto& info) {
                           std::string n = info.param.preset + "_" + DTypeName(info.param.dtype);
                           for (char& ch : n)
                             if (ch == '-' || ch == '.') ch = '_';
                           return n;
                         });

// Weights written between steps (a checkpoint read into the parameters writes the experts' homes) are what the
// next step reads: no slot keeps a layer's old bytes.
TEST(ExpertOffloadStepTest, ReadsWeightsWrittenBetweenSteps) {
  const std::vector<Sequence> batch = RaggedBatch(97, 99);
  auto resident = Moe("tiny-qwen3-moe", DType::kF64), offloaded = Moe("tiny-qwen3-moe", DType::kF64);
  Trainer a(*resident, Options("seco", false), {}), b(*offloaded, Options("seco", true), {});
  for (int step = 0; step < 2; ++step) {
    auto x = a.ComputeGradients(batch), y = b.ComputeGradients(batch);
    ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
    EXPECT_EQ(x->loss, y->loss) << "step " << step;
    for (Model* m : {resident.get(), offloaded.get()})  // every layer's experts change
      for (Param& p : m->params())
        if (p.name.find("mlp.experts.") != std::string::npos && p.name.find("lora") == std::string::npos)
          SetFromHost(p.value, [](int64_t i) { return 0.01 * static_cast<double>(i % 7); });
  }
}

// A model created with its experts at home (CreateTransformer's offload_experts) never holds more than one MoE
// layer's experts beside its slots, not even while it is created, and trains to the bits of one whose experts the
// Trainer moved.
TEST(ExpertOffloadStepTest, CreatedAtHomeHoldsOneLayerAtMost) {
  const std::vector<Sequence> batch = RaggedBatch(97, 3);
  auto moved = Moe("tiny-qwen3-moe", DType::kF64), created = Moe("tiny-qwen3-moe", DType::kF64, true, true);
  auto peak = [](Model& m) { return m.memory().Snapshot().peak[static_cast<int>(MemCategory::kWeights)]; };
  int64_t expert_bytes = 0, moe_layers = 0;
  for (const Param& p : moved->params())
    if (p.name.find("mlp.experts.") != std::string::npos && p.name.find("lora") == std::string::npos) {
      expert_bytes += static_cast<int64_t>(p.value.nbytes());
      moe_layers += p.name.find("gate_up") != std::string::npos;
    }
  ASSERT_GT(moe_layers, 1);
  const int64_t layer_bytes = expert_bytes / moe_layers;
  EXPECT_EQ(created->OffloadedWeightBytes(), expert_bytes);
  EXPECT_LE(peak(*created), peak(*moved) - expert_bytes + layer_bytes);  // the layer being made at most
  Trainer a(*moved, Options("seco", true), {}), b(*created, Options("seco", true), {});
  for (int step = 0; step < 2; ++step) {
    auto x = a.Step(batch), y = b.Step(batch);
    ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
    EXPECT_EQ(x->loss, y->loss) << "step " << step;
  }
  EXPECT_TRUE(Bytes(*moved) == Bytes(*created));
  // Refused at creation, naming the option: experts that would train, a model without experts.
  for (auto [preset, frozen] : {std::pair<const char*, bool>{"tiny-qwen3-moe", false}, {"tiny", true}}) {
    auto m = CreateTransformer(*TransformerPreset(preset), DType::kF64, Device::kCPU, {}, frozen, true);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << preset;
    EXPECT_NE(m.status().message().find("--offload_experts"), std::string::npos) << m.status();
  }
}

// Refused before any work, naming the option: experts that train (no frozen base), a model without experts.
TEST(ExpertOffloadStepTest, RefusesTrainedExpertsAndModelsWithoutExperts) {
  const std::vector<Sequence> batch = RaggedBatch(97, 1);
  auto trained = Moe("tiny-qwen3-moe", DType::kF64, /*frozen_base=*/false);
  auto dense = CreateTransformer(*TransformerPreset("tiny"), DType::kF64, Device::kCPU, {}, /*frozen_base=*/true);
  ASSERT_TRUE(dense.ok());
  LoraOptions lora;
  lora.rank = 2;
  lora.targets = {"q_proj"};
  ASSERT_TRUE(EnableLora(**dense, lora).ok());  // something to train: the refusal is offload's
  for (Model* m : {static_cast<Model*>(trained.get()), static_cast<Model*>(dense->get())}) {
    const absl::Status check = ValidateStrategyForModel(Options("seco", true), *m);
    EXPECT_EQ(check.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(check.message().find("--offload_experts"), std::string::npos) << check;
    Trainer t(*m, Options("seco", true), {});
    auto r = t.Step(batch);
    EXPECT_EQ(r.status(), check);
    EXPECT_EQ(m->OffloadedWeightBytes(), 0);
  }
  EXPECT_NE(ValidateStrategyForModel(Options("seco", true), *trained).message().find("mlp.experts.gate_up_proj"),
            std::string::npos);
}

}  // namespace
}  // namespace sg
