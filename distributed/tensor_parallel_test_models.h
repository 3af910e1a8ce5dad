// The models, batches and comparisons the tensor-parallel tests share (tensor_parallel_test.cc on the CPU,
// tensor_parallel_cuda_test.cc on the emulated GPU): whole models of each family, their split twins, and the worst
// relative difference between a split model's gathered parameters or gradients and the whole model's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/gradcheck.h"
#include "core/lora.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "distributed/tensor_parallel.h"

namespace sg::dist {

// GQA with 8 query heads over 4 KV heads, so that TP = 2 and 4 both split it; vocabulary 96.
inline TransformerConfig Config(const std::string& family) {
  TransformerConfig c;
  c.architecture = family;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 4;
  c.intermediate_size = 48;
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 4096;
  if (family == "llama") c.mlp_bias = true;  // gate/up biases split, down's replicated
  if (family == "qwen2") c.attention_bias = c.tie_word_embeddings = true;
  if (family == "qwen3") c.attention_bias = true, c.head_dim = 8;  // q/k norms; o_proj bias
  return c;
}

// Mamba presets: "tiny-ssm" (its vocabulary of 97 made 96, so that it splits: 97 is refused, see
// TensorParallelBadInput), "tiny-ssm+bias" (in_proj / out_proj biases, untied LM head) and "bench-ssm" as they are.
inline bool IsSsm(const std::string& family) { return absl::StartsWith(family, "tiny-ssm") || family == "bench-ssm"; }
inline MambaConfig SsmConfig(const std::string& family) {
  MambaConfig c = *MambaPreset(family == "bench-ssm" ? family : "tiny-ssm");
  if (family != "bench-ssm") c.vocab_size = 96;
  if (family == "tiny-ssm+bias") c.use_bias = true, c.tie_word_embeddings = false;
  return c;
}

struct TpRun {
  std::string family = "llama", strategy = "seco";
  bool offload = false;
  int64_t sparse_pages = 0;
  bool lora = false;
  double lora_dropout = 0;
  DType dtype = DType::kF64;
  std::string objective = "sft";
};

inline std::string Name(const TpRun& r, int tp, int dp) {
  return absl::StrCat(r.family, "/", r.strategy, r.offload ? "+offload" : "", r.sparse_pages ? "+sparse" : "",
                      r.lora ? (r.lora_dropout > 0 ? "+lora+dropout" : "+lora") : "",
                      r.dtype == DType::kBF16  ? "+bf16"
                      : r.dtype == DType::kF32 ? "+f32"
                                               : "",
                      "/", r.objective, " tp=", tp, " dp=", dp);
}

inline StrategyOptions Strategy(const TpRun& r) {
  StrategyOptions o;
  o.name = r.strategy;
  if (r.strategy == "adjoint-scan") o.name = "adjoint", o.adjoint_form = "scan";
  if (r.strategy == "adjoint-window") o.name = "adjoint", o.adjoint_window = 3;  // truncated: the relay is split too
  o.chunk = 5;
  o.page_size = 4;
  o.lm_chunk = 7;
  o.spaco_budget = 2;
  o.seed = 5;
  o.offload = r.offload;
  o.sparse_pages = r.sparse_pages;
  return o;
}

inline std::unique_ptr<Model> Whole(const TpRun& r) {
  absl::StatusOr<std::unique_ptr<Model>> m;
  if (IsSsm(r.family)) {
    auto made = CreateMamba(SsmConfig(r.family), r.dtype);
    if (made.ok())
      m = std::unique_ptr<Model>(std::move(*made));
    else
      m = made.status();
  } else {
    auto made = CreateTransformer(Config(r.family), r.dtype);
    if (made.ok())
      m = std::unique_ptr<Model>(std::move(*made));
    else
      m = made.status();
  }
  EXPECT_TRUE(m.ok()) << m.status();
  if (r.lora) {
    LoraOptions lo;
    lo.rank = 2;
    lo.dropout = r.lora_dropout;
    lo.targets = IsSsm(r.family) ? std::vector<std::string>{"in_proj", "x_proj"}  // PEFT's Mamba targets
                                 : std::vector<std::string>{"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                            "gate_proj", "up_proj", "down_proj"};
    EXPECT_TRUE(EnableLora(**m, lo).ok());
  }
  InitOptions init;
  init.seed = 7;
  init.stddev = r.family == "bench-ssm" ? 0.05 : 0.3;  // 256 wide: 0.3 saturates it (loss 17 over 512 tokens)
  init.perturb_norms_and_biases = true;
  InitRandom(**m, init);  // adapters too: B != 0, so every adapter gradient is exercised
  // Mamba: a slowly decaying scan (long memory), so that the states carried across chunks matter.
  if (auto* ssm = dynamic_cast<MambaModel*>(m->get())) InitMambaScan(*ssm, 7);
  return std::move(*m);
}

// device: the whole model's when omitted.
inline std::unique_ptr<Model> SplitOf(Model& whole, const TensorParallel& tp,
                                      std::optional<Device> device = std::nullopt) {
  absl::StatusOr<std::unique_ptr<Model>> m = SplitModel(whole, tp, device);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

// Four ragged sequences (23, 9, 23, 9 tokens), or dpo pairs.
inline Batch WholeBatch(const TpRun& r, Model& model) {
  Batch b;
  if (r.objective == "dpo") {
    ObjectiveOptions obj;
    obj.name = "dpo";
    for (uint64_t seed : {3u, 4u}) b.pairs = MakeCheckBatch(model, obj, 17, seed)->pairs;
    return b;
  }
  for (uint64_t seed : {12345u, 777u}) {
    std::vector<Sequence> part = RaggedBatch(model.vocab_size(), seed);
    b.sequences.insert(b.sequences.end(), part.begin(), part.end());
  }
  return b;
}

inline double Norm(const Tensor& t, const Tensor* minus = nullptr) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double a = t.dtype() == DType::kF64    ? t.data<double>()[i]
                     : t.dtype() == DType::kBF16 ? BF16ToF32(t.data<uint16_t>()[i])
                                                 : t.data<float>()[i];
    const double b = !minus                           ? 0.0
                     : minus->dtype() == DType::kF64  ? minus->data<double>()[i]
                     : minus->dtype() == DType::kBF16 ? BF16ToF32(minus->data<uint16_t>()[i])
                                                      : minus->data<float>()[i];
    s += (a - b) * (a - b);
  }
  return std::sqrt(s);
}

// The worst relative difference ||split - whole|| / ||whole|| over the parameters (values or gradients), the split
// model's blocks gathered first (into a twin of the whole model).
inline double WorstRelDiff(const TpRun& r, Model& whole, Model& split, bool grads, std::string* where) {
  std::unique_ptr<Model> twin = Whole(r);
  EXPECT_TRUE((grads ? GatherGrads(split, *twin) : GatherParams(split, *twin)).ok());
  double worst = 0;
  for (size_t i = 0; i < whole.params().size(); ++i) {
    const Tensor& ref = grads ? whole.params()[i].grad : whole.params()[i].value;
    const Tensor& gathered = grads ? twin->params()[i].grad : twin->params()[i].value;
    if (!ref.defined()) continue;
    const double scale = Norm(ref), diff = Norm(gathered, &ref);
    const double rel = scale > 0 ? diff / scale : diff;
    if (rel > worst) worst = rel, *where = whole.params()[i].name;
  }
  return worst;
}

// After both trainers computed a step's gradients (want: one process, got: split): loss, the split gradients
// (gathered) and, after both optimizer steps, the clipped norm agree within `tolerance`. Returns the worst relative
// gradient difference (where: its parameter).
inline double CheckStep(const TpRun& r, const std::string& name, int step, double tolerance, Model& whole, Model& split,
                        Trainer& reference, Trainer& trainer, StepMetrics& want, StepMetrics& got, std::string* where) {
  EXPECT_NEAR(got.loss, want.loss, tolerance * std::abs(want.loss)) << name << " step " << step;
  const double grad_diff = WorstRelDiff(r, whole, split, /*grads=*/true, where);
  EXPECT_LE(grad_diff, tolerance) << name << " step " << step << ": gradient of " << *where;
  EXPECT_TRUE(reference.OptimizerStep(&want).ok()) << name << " step " << step;
  EXPECT_TRUE(trainer.OptimizerStep(&got).ok()) << name << " step " << step;
  EXPECT_NEAR(got.grad_norm, want.grad_norm, tolerance * want.grad_norm) << name << " step " << step;
  return grad_diff;
}

}  // namespace sg::dist
