// LoRA (core/lora.h, core/lora_io.h), f64 on the tiny presets of both families: every exact strategy's adapter
// gradients against full backprop (with and without dropout), full backprop against finite differences, frozen
// base weights with no gradient or optimizer memory, the PEFT round trip and file layout, the merged export, and
// bad adapter files; LoRA on a MoE model's fused expert weights (PEFT's target_parameters).
#include "core/lora.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/gradcheck.h"
#include "core/io/peft.h"
#include "core/io/safetensors.h"
#include "core/lora_io.h"
#include "core/model_io.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "nlohmann/json.hpp"

namespace sg {
namespace {

std::unique_ptr<Model> Base(const std::string& preset, uint64_t seed = 7, bool frozen_base = false) {
  std::unique_ptr<Model> model;
  if (absl::StatusOr<TransformerConfig> t = TransformerPreset(preset); t.ok()) {
    auto m = CreateTransformer(*t, DType::kF64, Device::kCPU, {}, frozen_base);
    EXPECT_TRUE(m.ok()) << m.status();
    model = std::move(*m);
  } else {
    MambaConfig c = *MambaPreset(preset);
    c.use_bias = true;  // in_proj / out_proj biases: the adapters must leave them frozen
    auto m = CreateMamba(c, DType::kF64, Device::kCPU, {}, frozen_base);
    EXPECT_TRUE(m.ok()) << m.status();
    model = std::move(*m);
  }
  InitOptions init;
  init.seed = seed;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(*model, init);
  return model;
}

LoraOptions Options(const Model& m, int64_t rank, double dropout, bool all = true) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = 2.0 * rank;
  o.dropout = dropout;
  o.seed = 3;
  o.targets = all ? LoraTargetModules(LoraKind::Of(m)) : std::vector<std::string>{"q_proj", "v_proj"};
  return o;
}

// A model with LoRA on every module of its family and random B (so that both A and B have gradients).
std::unique_ptr<Model> WithLora(const std::string& preset, int64_t rank = 3, double dropout = 0) {
  std::unique_ptr<Model> model = Base(preset);
  absl::Status s = EnableLora(*model, Options(*model, rank, dropout));
  EXPECT_TRUE(s.ok()) << s;
  RandomizeLoraB(*model, 5, 0.3);
  return model;
}

std::vector<Sequence> Batch(const Model& m) { return RaggedBatch(m.vocab_size(), 4242); }

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + name;
}

double Loss(Model& m, const std::vector<Sequence>& batch) {
  Trainer t(m, StrategyOptions{}, {});
  absl::StatusOr<StepMetrics> r = t.EvaluateLoss(batch);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->loss : NAN;
}

int64_t AdapterBytes(Model& m) {
  int64_t bytes = 0;
  for (const LoraAdapter& ad : m.lora()->adapters)
    bytes += m.params()[ad.a].value.nbytes() + m.params()[ad.b].value.nbytes();
  return bytes;
}

// ---- gradients ----

struct Case {
  std::string preset, strategy;
  int64_t chunk;
  double dropout;
  std::string form = "pairs";
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.preset << " " << c.strategy << " chunk " << c.chunk << " dropout " << c.dropout;
}

class LoraStrategyTest : public ::testing::TestWithParam<Case> {};

TEST_P(LoraStrategyTest, AdapterGradientsMatchFullBackprop) {
  const Case& c = GetParam();
  auto model = WithLora(c.preset, 3, c.dropout);
  StrategyOptions o;
  o.name = c.strategy;
  o.chunk = c.chunk;
  o.page_size = 3;
  o.lm_chunk = 5;
  o.adjoint_form = c.form;
  o.spaco_budget = 1000;  // spaco below: every chunk kept (exact); set to the chunk count
  o.spaco_cap = 0;
  std::vector<Sequence> batch = Batch(*model);
  if (c.strategy == "spaco") {
    batch.resize(1);
    o.spaco_budget = (static_cast<int64_t>(batch[0].ids.size()) + c.chunk - 1) / c.chunk;
  }
  absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, batch, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->params_checked, 2 * static_cast<int64_t>(model->lora()->adapters.size()));
  EXPECT_NEAR(r->loss, r->reference_loss, 1e-12);
  EXPECT_LE(r->max_rel_err, 1e-10) << "worst: " << r->worst_param;
}

INSTANTIATE_TEST_SUITE_P(Exact, LoraStrategyTest,
                         ::testing::Values(Case{"tiny", "ckpt", 512, 0}, Case{"tiny", "seco", 4, 0},
                                           Case{"tiny", "streambp", 5, 0}, Case{"tiny", "seco", 4, 0.3},
                                           Case{"tiny", "streambp", 4, 0.3}, Case{"tiny", "ckpt", 512, 0.3},
                                           Case{"tiny", "spaco", 6, 0.3}, Case{"tiny-qwen2", "seco", 3, 0.25},
                                           Case{"tiny-qwen2", "streambp", 7, 0.25}, Case{"tiny-ssm", "ckpt", 512, 0},
                                           Case{"tiny-ssm", "seco", 4, 0}, Case{"tiny-ssm", "seco", 5, 0.3},
                                           Case{"tiny-ssm", "streambp", 4, 0.3}, Case{"tiny-ssm", "adjoint", 4, 0.3},
                                           Case{"tiny-ssm", "adjoint", 6, 0, "scan"},
                                           Case{"tiny-mamba2", "seco", 5, 0.3}, Case{"tiny-bamba", "streambp", 4, 0.3},
                                           Case{"tiny-nemotron-h", "seco", 4, 0}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string preset = info.param.preset;
                           for (char& ch : preset)
                             if (ch == '-') ch = '_';
                           return preset + "_" + info.param.strategy +
                                  (info.param.form != "pairs" ? "_" + info.param.form : "") + "_chunk" +
                                  std::to_string(info.param.chunk) + (info.param.dropout > 0 ? "_dropout" : "");
                         });

// Central differences of the batch loss on every adapter tensor, with and without dropout (a fresh Trainer per
// evaluation draws the same masks: they depend on the sequence seed, not on the weights).
TEST(LoraFiniteDifferencesTest, FullBackpropMatches) {
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-ssm"})
    for (double dropout : {0.0, 0.4}) {
      auto model = WithLora(preset, 2, dropout);
      const std::vector<Sequence> batch = Batch(*model);
      auto loss = [&] {
        Trainer t(*model, StrategyOptions{}, {});
        return t.ComputeGradients(batch)->loss;
      };
      Trainer trainer(*model, StrategyOptions{}, {});
      ASSERT_TRUE(trainer.ComputeGradients(batch).ok());
      std::vector<std::vector<double>> analytic;
      for (const LoraAdapter& ad : model->lora()->adapters)
        for (int idx : {ad.a, ad.b}) {
          const Tensor& g = model->params()[idx].grad;
          analytic.emplace_back(g.data<double>(), g.data<double>() + g.numel());
        }
      size_t k = 0;
      for (const LoraAdapter& ad : model->lora()->adapters)
        for (int idx : {ad.a, ad.b}) {
          Param& p = model->params()[idx];
          double* w = p.value.data<double>();
          for (int64_t i = 0; i < p.value.numel(); i += std::max<int64_t>(1, p.value.numel() / 3)) {
            const double saved = w[i], h = 1e-5;
            w[i] = saved + h;
            const double up = loss();
            w[i] = saved - h;
            const double down = loss();
            w[i] = saved;
            EXPECT_NEAR(analytic[k][i], (up - down) / (2 * h), 1e-7 * std::max(1.0, std::abs(analytic[k][i])))
                << preset << " dropout " << dropout << " " << p.name << "[" << i << "]";
          }
          ++k;
        }
    }
}

// Dropout is on in gradient passes only, changes the loss there, and draws a new mask per step.
TEST(LoraDropoutTest, TrainingOnlyAndFreshEachStep) {
  auto plain = WithLora("tiny", 3, 0.0);
  auto dropped = WithLora("tiny", 3, 0.5);
  const std::vector<Sequence> batch = Batch(*plain);
  EXPECT_DOUBLE_EQ(Loss(*plain, batch), Loss(*dropped, batch));  // evaluation: no dropout
  Trainer a(*plain, StrategyOptions{}, {}), b(*dropped, StrategyOptions{}, {});
  const double plain_loss = a.ComputeGradients(batch)->loss;
  const double first = b.ComputeGradients(batch)->loss, second = b.ComputeGradients(batch)->loss;
  EXPECT_NEAR(plain_loss, Loss(*plain, batch), 1e-12);
  EXPECT_GT(std::abs(first - plain_loss), 1e-6);
  EXPECT_GT(std::abs(second - first), 1e-6);
  // The mask keeps a fraction 1 - p of the elements.
  int64_t kept = 0, total = 0;
  for (int64_t pos = 0; pos < 200; ++pos) {
    const uint64_t key = LoraRowKey(99, 4, pos);
    for (int64_t f = 0; f < 100; ++f, ++total) kept += LoraKeep(key, f, 0.3);
  }
  EXPECT_NEAR(static_cast<double>(kept) / total, 0.7, 0.02);
}

// ---- frozen base, memory ----

TEST(LoraFreezeTest, BaseFrozenAndOnlyAdapterMemory) {
  for (const std::string preset : {"tiny", "tiny-ssm"}) {
    auto model = Base(preset);
    std::vector<std::vector<double>> before;
    for (Param& p : model->params())
      before.emplace_back(p.value.data<double>(), p.value.data<double>() + p.value.numel());
    const size_t base_params = model->params().size();
    ASSERT_TRUE(EnableLora(*model, Options(*model, 4, 0.1)).ok());
    EXPECT_EQ(model->params().size(), base_params + 2 * model->lora()->adapters.size());
    for (size_t i = 0; i < base_params; ++i) EXPECT_FALSE(model->params()[i].grad.defined()) << model->params()[i].name;
    for (const LoraAdapter& ad : model->lora()->adapters) {
      EXPECT_TRUE(model->params()[ad.a].grad.defined());
      // B starts at zero (PEFT), A is uniform in +-1/sqrt(in).
      const Tensor& b = model->params()[ad.b].value;
      for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(b.data<double>()[i], 0.0);
      const Tensor& a = model->params()[ad.a].value;
      double amax = 0;
      for (int64_t i = 0; i < a.numel(); ++i) amax = std::max(amax, std::abs(a.data<double>()[i]));
      EXPECT_LE(amax, 1 / std::sqrt(static_cast<double>(ad.in)));
      EXPECT_GT(amax, 0.5 / std::sqrt(static_cast<double>(ad.in)));
    }
    // The zero B leaves the model's function unchanged.
    std::unique_ptr<Model> plain = Base(preset);
    EXPECT_DOUBLE_EQ(Loss(*model, Batch(*model)), Loss(*plain, Batch(*model)));

    const int64_t adapter_bytes = AdapterBytes(*model);
    StrategyOptions o;
    o.name = "seco";
    o.chunk = 5;
    OptimizerOptions opt;
    opt.lr = 1e-2;
    Trainer trainer(*model, o, opt);
    for (int step = 0; step < 3; ++step) ASSERT_TRUE(trainer.Step(Batch(*model)).ok());
    const MemorySnapshot mem = model->memory().Snapshot();
    EXPECT_EQ(mem.peak[static_cast<int>(MemCategory::kGrads)], adapter_bytes) << preset;
    EXPECT_EQ(mem.current[static_cast<int>(MemCategory::kOptimizer)], 2 * adapter_bytes) << preset;
    for (size_t i = 0; i < base_params; ++i) {
      const Param& p = model->params()[i];
      for (int64_t j = 0; j < p.value.numel(); ++j)
        ASSERT_EQ(p.value.data<double>()[j], before[i][j]) << preset << " " << p.name << " changed";
    }
    double bmax = 0;
    for (const LoraAdapter& ad : model->lora()->adapters)
      for (int64_t j = 0; j < model->params()[ad.b].value.numel(); ++j)
        bmax = std::max(bmax, std::abs(model->params()[ad.b].value.data<double>()[j]));
    EXPECT_GT(bmax, 1e-3) << preset << ": the adapters did not train";
  }
}

// A model created with a frozen base (as the tools create one for LoRA) never holds a gradient of the base: before
// LoRA none at all, after it the adapters' alone; training then gives the adapters bit for bit what a model that
// had the base's gradients and released them gives.
TEST(LoraFreezeTest, CreatedFrozenNeverHoldsTheBaseGradients) {
  for (const std::string preset : {"tiny", "tiny-ssm"}) {
    auto frozen = Base(preset, 7, /*frozen_base=*/true);
    for (const Param& p : frozen->params()) EXPECT_FALSE(p.grad.defined()) << preset << " " << p.name;
    EXPECT_EQ(frozen->memory().Snapshot().peak[static_cast<int>(MemCategory::kGrads)], 0) << preset;
    auto released = Base(preset, 7);
    EXPECT_GT(released->memory().Snapshot().peak[static_cast<int>(MemCategory::kGrads)], 0) << preset;
    ASSERT_TRUE(EnableLora(*frozen, Options(*frozen, 4, 0.1)).ok());
    ASSERT_TRUE(EnableLora(*released, Options(*released, 4, 0.1)).ok());
    EXPECT_EQ(frozen->memory().Snapshot().peak[static_cast<int>(MemCategory::kGrads)], AdapterBytes(*frozen)) << preset;
    StrategyOptions o;
    o.name = "seco";
    o.chunk = 5;
    OptimizerOptions opt;
    opt.lr = 1e-2;
    Trainer a(*frozen, o, opt), b(*released, o, opt);
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE(a.Step(Batch(*frozen)).ok());
      ASSERT_TRUE(b.Step(Batch(*released)).ok());
    }
    ASSERT_EQ(frozen->params().size(), released->params().size());
    for (size_t i = 0; i < frozen->params().size(); ++i) {
      const Param &p = frozen->params()[i], &q = released->params()[i];
      ASSERT_EQ(p.name, q.name);
      ASSERT_EQ(p.grad.defined(), q.grad.defined()) << p.name;
      for (int64_t j = 0; j < p.value.numel(); ++j)
        ASSERT_EQ(p.value.data<double>()[j], q.value.data<double>()[j]) << preset << " " << p.name;
    }
  }
}

TEST(LoraOptionsTest, BadOptions) {
  auto model = Base("tiny");
  auto error = [&](LoraOptions o) {
    absl::Status s = EnableLora(*model, o);
    EXPECT_FALSE(s.ok());
    return std::string(s.message());
  };
  LoraOptions o = Options(*model, 4, 0);
  o.rank = 0;
  EXPECT_NE(error(o).find("--lora_rank must be positive"), std::string::npos);
  o = Options(*model, 4, 0);
  o.alpha = -1;
  EXPECT_NE(error(o).find("--lora_alpha"), std::string::npos);
  o = Options(*model, 4, 0);
  o.dropout = 1;
  EXPECT_NE(error(o).find("--lora_dropout must be in [0, 1)"), std::string::npos);
  o = Options(*model, 4, 0);
  o.targets = {"q_proj", "x_proj"};
  EXPECT_NE(error(o).find("'x_proj' is not a linear module or expert weight of a transformer model"), std::string::npos)
      << error(o);
  o.targets = {"q_proj", "q_proj"};
  EXPECT_NE(error(o).find("listed twice"), std::string::npos);
  EXPECT_FALSE(ParseLoraTargets("q_proj,,v_proj", "transformer").ok());
  EXPECT_EQ(*ParseLoraTargets("q_proj, v_proj", "transformer"), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(ParseLoraTargets("all", "ssm")->size(), 2u);
  EXPECT_EQ(*ParseLoraTargets("All-Linear", "transformer"), LoraTargetModules("transformer"));
  EXPECT_NE(ParseLoraTargets("all-linear", "ssm").status().message().find("out_proj and dt_proj"), std::string::npos);
  // Mamba modules PEFT refuses or ignores are refused with the reason.
  EXPECT_NE(ParseLoraTargets("in_proj,out_proj", "ssm")
                .status()
                .message()
                .find("'out_proj' is not supported: PEFT "
                      "refuses"),
            std::string::npos);
  EXPECT_NE(ParseLoraTargets("dt_proj", "ssm").status().message().find("multiplies dt_proj.weight directly"),
            std::string::npos);
  ASSERT_TRUE(EnableLora(*model, Options(*model, 4, 0)).ok());
  EXPECT_NE(error(Options(*model, 4, 0)).find("already enabled"), std::string::npos);
}

// The Mamba-2 models' targets as PEFT 0.21 takes them: in_proj everywhere; out_proj only where PEFT allows it
// (bamba, not its Mamba model types mamba2 and nemotron_h); conv1d nowhere; "all-linear" refused where it would
// include a refused out_proj.
TEST(LoraOptionsTest, Mamba2TargetsAsPeft) {
  auto adapted = [](Model& m) {
    std::set<std::string> leaves;
    for (const LoraAdapter& ad : m.lora()->adapters) leaves.insert(ad.module.substr(ad.module.rfind('.') + 1));
    return leaves;
  };
  for (const char* preset : {"tiny-mamba2", "tiny-nemotron-h"}) {
    auto model = Base(preset);
    const LoraKind kind = LoraKind::Of(*model);
    for (const char* refused : {"out_proj", "conv1d"}) {
      absl::StatusOr<std::vector<std::string>> t = ParseLoraTargets(absl::StrCat("in_proj,", refused), kind);
      EXPECT_NE(t.status().message().find(
                    absl::StrCat("'", refused, "' is not supported on ", kind.architecture, ": PEFT refuses")),
                std::string::npos)
          << t.status();
    }
    EXPECT_NE(ParseLoraTargets("all-linear", kind).status().message().find("includes out_proj, which PEFT refuses"),
              std::string::npos)
        << preset;
    ASSERT_TRUE(EnableLora(*model, Options(*model, 2, 0)).ok()) << preset;  // "all": less out_proj
    EXPECT_EQ(adapted(*model).count("out_proj"), 0u) << preset;
    EXPECT_EQ(adapted(*model).count("in_proj"), 1u) << preset;
  }
  EXPECT_EQ(DefaultLoraTargets(LoraKind::Of(*Base("tiny-mamba2"))), "in_proj");
  EXPECT_EQ(DefaultLoraTargets(LoraKind::Of(*Base("tiny-nemotron-h"))), "q_proj,k_proj,v_proj,o_proj");
  EXPECT_EQ(adapted(*WithLora("tiny-nemotron-h")),
            (std::set<std::string>{"in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}));

  auto bamba = Base("tiny-bamba");
  const LoraKind kind = LoraKind::Of(*bamba);
  EXPECT_NE(ParseLoraTargets("conv1d", kind).status().message().find("read conv1d.weight directly"), std::string::npos);
  absl::StatusOr<std::vector<std::string>> all_linear = ParseLoraTargets("all-linear", kind);
  ASSERT_TRUE(all_linear.ok()) << all_linear.status();
  LoraOptions o = Options(*bamba, 2, 0);
  o.targets = *all_linear;
  ASSERT_TRUE(EnableLora(*bamba, o).ok());
  EXPECT_EQ(adapted(*bamba), (std::set<std::string>{"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"}));
}

// ---- dpo / grpo with the model without adapters as the reference ----

struct Batch PreferenceBatch(const Model& m, const std::string& objective) {
  struct Batch b;
  std::vector<Sequence> a = RaggedBatch(m.vocab_size(), 11), c = RaggedBatch(m.vocab_size(), 12);
  if (objective == "dpo") {
    b.pairs.push_back({a[0], c[0]});
    b.pairs.push_back({c[1], a[1]});
  } else {
    GrpoGroup g1, g2;
    auto completion = [](const Sequence& seq, double advantage) {
      GrpoCompletion out;
      out.seq = seq;
      out.advantage = advantage;
      return out;
    };
    g1.completions = {completion(a[0], 0.8), completion(c[0], -0.8)};
    g2.completions = {completion(a[1], 1.1), completion(c[1], -0.4), completion(a[0], -0.7)};
    b.groups = {g1, g2};
  }
  return b;
}

// The reference "this model with its adapters off" gives every digit of the two-model computation (the policy with
// LoRA + a separate copy of the base model as the reference), step after step, while holding no second copy of the
// weights: the engine's accounting shows the reference model's weights saved.
TEST(LoraReferenceTest, BaseModelReferenceEqualsTwoModelsWithoutTheirMemory) {
  for (const std::string preset : {"tiny", "tiny-ssm"})
    for (const std::string objective : {"dpo", "grpo"}) {
      SCOPED_TRACE(preset + " " + objective);
      auto two = WithLora(preset), one = WithLora(preset);
      auto reference = Base(preset);  // the same base weights as the policies'
      StrategyOptions s;
      s.name = "seco";
      s.chunk = 5;
      s.page_size = 3;
      ObjectiveOptions o;
      o.name = objective;
      o.grpo_kl_beta = 0.3;
      OptimizerOptions opt;
      opt.lr = 0.05;
      Trainer with_model(*two, s, opt, o, reference.get());
      Trainer with_base(*one, s, opt, o);
      with_base.set_reference_base_model();
      const struct Batch batch = PreferenceBatch(*one, objective);
      for (int step = 0; step < 2; ++step) {
        absl::StatusOr<StepMetrics> a = with_model.Step(batch), b = with_base.Step(batch);
        ASSERT_TRUE(a.ok()) << a.status();
        ASSERT_TRUE(b.ok()) << b.status();
        EXPECT_EQ(a->loss, b->loss) << "step " << step;
        if (objective == "dpo" && step == 0) {  // log 2 if the reference were the policy itself
          EXPECT_GT(std::abs(a->loss - std::log(2.0)), 1e-2);
        }
      }
      for (const LoraAdapter& ad : one->lora()->adapters)
        for (int idx : {ad.a, ad.b}) {
          const Tensor& x = one->params()[idx].value;
          const Tensor& y = two->params()[idx].value;
          for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(x.data<double>()[i], y.data<double>()[i]);
        }
      // The adapters moved, the reference did not: the base model's loss is not the policy's.
      EXPECT_NE(Loss(*one, Batch(*one)), Loss(*reference, Batch(*one)));
      constexpr int kW = static_cast<int>(MemCategory::kWeights);
      const int64_t reference_weights = reference->memory().Snapshot().current[static_cast<int>(MemCategory::kWeights)];
      const int64_t two_models = two->memory().Snapshot().peak[kW] + reference->memory().Snapshot().peak[kW];
      const int64_t one_model = one->memory().Snapshot().peak[kW];
      std::printf(
          "%s %s: weights bytes, policy + reference model %lld, policy with its adapters off as the "
          "reference %lld (saved %lld)\n",
          preset.c_str(), objective.c_str(), static_cast<long long>(two_models), static_cast<long long>(one_model),
          static_cast<long long>(two_models - one_model));
      EXPECT_EQ(two_models - one_model, reference_weights);
    }
}

TEST(LoraReferenceTest, BaseModelReferenceNeedsLora) {
  auto model = Base("tiny");
  ObjectiveOptions o;
  o.name = "dpo";
  Trainer t(*model, StrategyOptions{}, {}, o);
  t.set_reference_base_model();
  absl::StatusOr<StepMetrics> r = t.ComputeGradients(PreferenceBatch(*model, "dpo"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("LoRA is not enabled on the model"), std::string::npos) << r.status();
}

// ---- files ----

TEST(LoraFilesTest, RoundTripGivesIdenticalOutputs) {
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-ssm"}) {
    auto model = WithLora(preset, 3, 0.1);
    const std::vector<Sequence> batch = Batch(*model);
    const std::string dir = TempDir("adapter_" + preset);
    ASSERT_TRUE(SaveLoraAdapter(*model, dir, "base/" + preset).ok());

    auto loaded = Base(preset);  // the same base weights
    absl::Status s = LoadLoraAdapter(*loaded, dir);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_NE(loaded->lora(), nullptr);
    EXPECT_EQ(loaded->lora()->options.rank, 3);
    EXPECT_EQ(loaded->lora()->options.alpha, 6.0);
    EXPECT_EQ(loaded->lora()->options.dropout, 0.1);
    EXPECT_EQ(loaded->lora()->options.targets, model->lora()->options.targets);
    ASSERT_EQ(loaded->params().size(), model->params().size());
    for (size_t i = 0; i < model->params().size(); ++i) {
      const Tensor &x = model->params()[i].value, &y = loaded->params()[i].value;
      ASSERT_EQ(model->params()[i].name, loaded->params()[i].name);
      for (int64_t j = 0; j < x.numel(); ++j)
        ASSERT_EQ(x.data<double>()[j], y.data<double>()[j]) << model->params()[i].name;
    }
    EXPECT_EQ(Loss(*model, batch), Loss(*loaded, batch));
    // Training passes too (same dropout masks): identical gradients.
    Trainer ta(*model, StrategyOptions{}, {}), tb(*loaded, StrategyOptions{}, {});
    EXPECT_EQ(ta.ComputeGradients(batch)->loss, tb.ComputeGradients(batch)->loss);
    Trainer la(*model, StrategyOptions{}, {}), lb(*loaded, StrategyOptions{}, {});
    const std::vector<double> lp_a = *la.TokenLogprobs(*model, batch[0]), lp_b = *lb.TokenLogprobs(*loaded, batch[0]);
    ASSERT_EQ(lp_a.size(), lp_b.size());
    for (size_t t = 0; t < lp_a.size(); ++t)
      if (!std::isnan(lp_a[t])) {
        EXPECT_EQ(lp_a[t], lp_b[t]) << preset << " position " << t;
      }

    // Loading into a model whose LoRA is already on (same rank, alpha, targets) replaces the adapter weights.
    auto again = Base(preset);
    ASSERT_TRUE(EnableLora(*again, Options(*again, 3, 0.0)).ok());
    ASSERT_TRUE(LoadLoraAdapter(*again, dir).ok());
    EXPECT_EQ(Loss(*model, batch), Loss(*again, batch));
  }
}

// The layout HF PEFT documents and loads (PeftModel.from_pretrained): adapter_config.json with peft_type LORA, r,
// lora_alpha, lora_dropout, target_modules, bias "none", fan_in_fan_out false, task_type CAUSAL_LM,
// base_model_name_or_path; adapter_model.safetensors with "base_model.model.<module>.lora_A.weight" [r, in] and
// "....lora_B.weight" [out, r] for every targeted module and nothing else.
TEST(LoraFilesTest, PeftLayout) {
  auto model = Base("tiny");
  LoraOptions o = Options(*model, 4, 0.05, /*all=*/false);
  ASSERT_TRUE(EnableLora(*model, o).ok());
  const std::string dir = TempDir("adapter_layout");
  ASSERT_TRUE(SaveLoraAdapter(*model, dir, "meta-llama/Llama-3.2-1B").ok());
  std::ifstream in(dir + "/adapter_config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["task_type"], "CAUSAL_LM");
  EXPECT_TRUE(config["r"].is_number_integer());
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 8.0);
  EXPECT_EQ(config["lora_dropout"], 0.05);
  EXPECT_EQ(config["target_modules"], nlohmann::json({"q_proj", "v_proj"}));
  EXPECT_EQ(config["bias"], "none");
  EXPECT_EQ(config["fan_in_fan_out"], false);
  EXPECT_EQ(config["use_rslora"], false);
  EXPECT_EQ(config["use_dora"], false);
  EXPECT_EQ(config["base_model_name_or_path"], "meta-llama/Llama-3.2-1B");
  EXPECT_TRUE(config["modules_to_save"].is_null());

  absl::StatusOr<io::SafetensorsFile> file = io::SafetensorsFile::Open(dir + "/adapter_model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  std::set<std::string> names;
  for (const io::TensorInfo& t : file->tensors()) names.insert(t.name);
  std::set<std::string> expected;
  for (int l = 0; l < model->num_layers(); ++l)
    for (const char* m : {"q_proj", "v_proj"})
      for (const char* ab : {"A", "B"})
        expected.insert("base_model.model.model.layers." + std::to_string(l) + ".self_attn." + m + ".lora_" + ab +
                        ".weight");
  EXPECT_EQ(names, expected);
  const TransformerConfig& c = static_cast<TransformerModel&>(*model).config();
  const io::TensorInfo* a = file->Find("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight");
  const io::TensorInfo* b = file->Find("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight");
  EXPECT_EQ(a->shape, (std::vector<int64_t>{4, c.hidden_size}));
  EXPECT_EQ(b->shape, (std::vector<int64_t>{c.num_kv_heads * c.head_dim, 4}));
  EXPECT_EQ(a->dtype, io::StDType::kF64);

  // A config as PEFT itself writes it (extra keys, integer lora_alpha) parses.
  absl::StatusOr<io::PeftLoraConfig> peft = io::ParsePeftLoraConfig(
      R"({"alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": "x", "bias": "none",
          "corda_config": null, "eva_config": null, "exclude_modules": null, "fan_in_fan_out": false,
          "inference_mode": true, "init_lora_weights": true, "layer_replication": null, "layers_pattern": null,
          "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 16, "lora_bias": false,
          "lora_dropout": 0.05, "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null,
          "peft_type": "LORA", "r": 8, "rank_pattern": {}, "revision": null, "target_modules": ["v_proj", "q_proj"],
          "task_type": "CAUSAL_LM", "trainable_token_indices": null, "use_dora": false, "use_rslora": false})",
      "adapter_config.json");
  ASSERT_TRUE(peft.ok()) << peft.status();
  EXPECT_EQ(peft->r, 8);
  EXPECT_EQ(peft->lora_alpha, 16);
  EXPECT_EQ(peft->target_modules, (std::vector<std::string>{"v_proj", "q_proj"}));
}

// SaveModel of a LoRA model writes W + alpha/r B A and no adapter tensors: a plain HF model whose loss equals the
// adapter model's.
TEST(LoraFilesTest, MergedExportEqualsAdapterForward) {
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-ssm"}) {
    auto model = WithLora(preset, 3, 0.2);
    const std::vector<Sequence> batch = Batch(*model);
    const std::string dir = TempDir("merged_" + preset);
    ASSERT_TRUE(SaveModel(*model, dir).ok());
    absl::StatusOr<io::SafetensorsFile> file = io::SafetensorsFile::Open(dir + "/model.safetensors");
    ASSERT_TRUE(file.ok());
    for (const io::TensorInfo& t : file->tensors()) EXPECT_EQ(t.name.find("lora_"), std::string::npos) << t.name;
    absl::StatusOr<std::unique_ptr<Model>> merged = LoadAnyModel(dir, DType::kF64, 0);
    ASSERT_TRUE(merged.ok()) << merged.status();
    EXPECT_EQ((*merged)->lora(), nullptr);
    const double adapter_loss = Loss(*model, batch), merged_loss = Loss(**merged, batch);
    EXPECT_NEAR(adapter_loss, merged_loss, 1e-12) << preset;
    EXPECT_GT(std::abs(adapter_loss - Loss(*Base(preset), batch)), 1e-4) << preset << ": the adapters do nothing";
    // The live model is not changed by the export.
    EXPECT_EQ(Loss(*model, batch), adapter_loss);
  }
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}
std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// ---- expert weights (PEFT's target_parameters) ----

// A Qwen3-MoE of the tiny preset's shape: layers 0 and 2 sparse (4 experts of 8, top 2), layer 1 dense.
std::unique_ptr<Model> MoeBase() {
  TransformerConfig c = *TransformerPreset("tiny");
  c.architecture = "qwen3_moe";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.intermediate = 8;
  c.moe.normalize = false;
  c.moe_layers = {true, false, true};
  auto m = CreateTransformer(c, DType::kF64);
  EXPECT_TRUE(m.ok()) << m.status();
  InitOptions init;
  init.seed = 7;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**m, init);
  return std::move(*m);
}

LoraOptions ExpertOptions(std::vector<std::string> targets = {"q_proj", "experts.gate_up_proj", "experts.down_proj"}) {
  LoraOptions o;
  o.rank = 2;
  o.alpha = 5;
  o.seed = 3;
  o.targets = std::move(targets);
  return o;
}

std::unique_ptr<Model> MoeWithLora() {
  auto model = MoeBase();
  absl::Status s = EnableLora(*model, ExpertOptions());
  EXPECT_TRUE(s.ok()) << s;
  RandomizeLoraB(*model, 5, 0.3);
  return model;
}

// lora_A [E r][in] and lora_B [out][r E] per fused weight, under PEFT's nested wrapper names: gate_up_proj's (the
// module's first parameter) is the inner wrapper, "experts.base_layer"; alone it is "experts".
TEST(LoraExpertsTest, PeftNamesAndShapes) {
  auto model = MoeWithLora();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const Param& p : model->params())
    if (p.name.find("lora_") != std::string::npos) shapes[p.name] = p.value.shape();
  for (int layer : {0, 2}) {
    const std::string e = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    EXPECT_EQ(shapes[e + "base_layer.lora_A.weight"], (std::vector<int64_t>{8, 32}));
    EXPECT_EQ(shapes[e + "base_layer.lora_B.weight"], (std::vector<int64_t>{16, 8}));
    EXPECT_EQ(shapes[e + "lora_A.weight"], (std::vector<int64_t>{8, 8}));
    EXPECT_EQ(shapes[e + "lora_B.weight"], (std::vector<int64_t>{32, 8}));
  }
  EXPECT_EQ(shapes.size(), 3u * 2 + 2 * 4) << "q_proj in 3 layers, 2 expert weights in 2 layers";
  auto alone = MoeBase();
  ASSERT_TRUE(EnableLora(*alone, ExpertOptions({"experts.down_proj"})).ok());
  EXPECT_EQ(alone->params()[alone->lora()->adapters[0].b].name, "model.layers.0.mlp.experts.lora_B.weight");
  EXPECT_EQ(alone->params()[alone->lora()->adapters[0].b].value.shape(), (std::vector<int64_t>{32, 8}));
}

TEST(LoraExpertsTest, GradientsMatchFullBackpropAndFiniteDifferences) {
  auto model = MoeWithLora();
  const std::vector<Sequence> batch = Batch(*model);
  for (auto [strategy, chunk] : std::vector<std::pair<std::string, int64_t>>{{"seco", 4}, {"streambp", 5}}) {
    StrategyOptions o;
    o.name = strategy;
    o.chunk = chunk;
    o.page_size = 3;
    o.lm_chunk = 5;
    absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, batch, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->params_checked, 2 * 7);
    EXPECT_LE(r->max_rel_err, 1e-10) << strategy << " worst: " << r->worst_param;
  }
  auto loss = [&] { return Trainer(*model, StrategyOptions{}, {}).ComputeGradients(batch)->loss; };
  Trainer trainer(*model, StrategyOptions{}, {});
  ASSERT_TRUE(trainer.ComputeGradients(batch).ok());
  std::map<int, std::vector<double>> analytic;  // every gradient before the differences overwrite them
  for (const LoraAdapter& ad : model->lora()->adapters)
    for (int idx : {ad.a, ad.b}) {
      const Tensor& g = model->params()[idx].grad;
      if (ad.experts) analytic[idx].assign(g.data<double>(), g.data<double>() + g.numel());
    }
  for (auto& [idx, grad] : analytic) {
    Param& p = model->params()[idx];
    double* w = p.value.data<double>();
    auto at = [&](int64_t i, double v) {
      const double saved = w[i];
      w[i] = v;
      const double l = loss();
      w[i] = saved;
      return l;
    };
    for (int64_t i = 0; i < p.value.numel(); i += 11) {  // stride 11: every expert's rows and columns
      const double h = 1e-4;  // fourth-order central differences, a step that flips no routing choice
      const double fd =
          (8 * (at(i, w[i] + h) - at(i, w[i] - h)) - (at(i, w[i] + 2 * h) - at(i, w[i] - 2 * h))) / (12 * h);
      EXPECT_NEAR(grad[i], fd, 1e-8 * std::max(1.0, std::abs(grad[i]))) << p.name << "[" << i << "]";
    }
  }
}

// Saved and loaded back: the same tensors and loss; adapter_config.json lists the expert weights as
// target_parameters; the merged export is the adapter model.
TEST(LoraExpertsTest, RoundTripAndMergedExport) {
  auto model = MoeWithLora();
  const std::vector<Sequence> batch = Batch(*model);
  const std::string dir = TempDir("adapter_experts");
  ASSERT_TRUE(SaveLoraAdapter(*model, dir, "moe").ok());
  std::ifstream in(dir + "/adapter_config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  EXPECT_EQ(config["target_modules"], nlohmann::json({"q_proj"}));
  EXPECT_EQ(config["target_parameters"], nlohmann::json({"experts.gate_up_proj", "experts.down_proj"}));
  auto loaded = MoeBase();
  absl::Status s = LoadLoraAdapter(*loaded, dir);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(loaded->lora()->options.targets, model->lora()->options.targets);
  EXPECT_EQ(Loss(*model, batch), Loss(*loaded, batch));
  const std::string merged_dir = TempDir("merged_experts");
  ASSERT_TRUE(SaveModel(*model, merged_dir).ok());
  absl::StatusOr<std::unique_ptr<Model>> merged = LoadAnyModel(merged_dir, DType::kF64, 0);
  ASSERT_TRUE(merged.ok()) << merged.status();
  const double adapter_loss = Loss(*model, batch);
  EXPECT_NEAR(adapter_loss, Loss(**merged, batch), 1e-12);
  auto experts_only = MoeBase();
  ASSERT_TRUE(EnableLora(*experts_only, ExpertOptions({"experts.gate_up_proj"})).ok());
  RandomizeLoraB(*experts_only, 5, 0.3);
  EXPECT_GT(std::abs(Loss(*experts_only, batch) - Loss(*MoeBase(), batch)), 1e-4) << "the expert adapter does nothing";

  // target_parameters as PEFT writes them (paths, target_modules []) name the same weights; a router is refused.
  std::string text = ReadBytes(dir + "/adapter_config.json");
  auto replace = [&](const std::string& from, const std::string& to) {
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    WriteBytes(dir + "/adapter_config.json", text);
  };
  replace("\"experts.gate_up_proj\"", "\"mlp.experts.gate_up_proj\"");
  EXPECT_TRUE(LoadLoraAdapter(*MoeBase(), dir).ok());
  replace("\"experts.down_proj\"", "\"mlp.gate.weight\"");
  s = LoadLoraAdapter(*MoeBase(), dir);
  EXPECT_NE(s.message().find("adapter_config.json: target_parameters: 'mlp.gate.weight' is not supported"),
            std::string::npos)
      << s;
}

TEST(LoraExpertsTest, BadOptions) {
  auto model = MoeBase();
  LoraOptions o = ExpertOptions();
  o.dropout = 0.1;
  absl::Status s = EnableLora(*model, o);
  EXPECT_NE(s.message().find("--lora_dropout 0.1 with the expert weight 'experts.gate_up_proj' in --lora_targets: "
                             "PEFT refuses lora_dropout != 0 on target_parameters"),
            std::string::npos)
      << s;
  s = EnableLora(*model, ExpertOptions({"experts.up_proj"}));
  EXPECT_NE(s.message().find("'experts.up_proj' is not a linear module or expert weight"), std::string::npos) << s;
  // PEFT would retarget these to the fused experts (qwen3_moe, qwen3_next): refused, naming the alternative.
  s = EnableLora(*model, ExpertOptions({"q_proj", "down_proj"}));
  EXPECT_NE(s.message().find("--lora_targets: 'down_proj' on a qwen3_moe model: PEFT 0.21 retargets"),
            std::string::npos)
      << s;
  s = EnableLora(*Base("tiny"), ExpertOptions({"experts.down_proj"}));
  EXPECT_NE(s.message().find("no module of this model is named experts.down_proj"), std::string::npos) << s;
  EXPECT_EQ(model->lora(), nullptr);
}

// PEFT writes target_modules in any order, as module names or (after "all-linear") as module paths: the same set
// of modules loads the same adapter; "all-linear" means every linear layer but the LM head.
TEST(LoraFilesTest, TargetModulesAreASetOfNamesOrPaths) {
  auto source = WithLora("tiny", 3);  // every module of the family
  const std::vector<Sequence> batch = Batch(*source);
  const std::string dir = TempDir("adapter_targets");
  ASSERT_TRUE(SaveLoraAdapter(*source, dir, "tiny").ok());
  const std::string config_path = dir + "/adapter_config.json";
  nlohmann::json config = nlohmann::json::parse(ReadBytes(config_path));
  std::vector<std::string> paths;
  for (const LoraAdapter& ad : source->lora()->adapters) paths.push_back(ad.module);
  std::reverse(paths.begin(), paths.end());
  for (const nlohmann::json& targets :
       {nlohmann::json(paths), nlohmann::json("ALL-LINEAR"),
        nlohmann::json({"down_proj", "up_proj", "gate_proj", "o_proj", "v_proj", "k_proj", "q_proj", "q_proj"})}) {
    config["target_modules"] = targets;
    WriteBytes(config_path, config.dump());
    auto loaded = Base("tiny");
    absl::Status s = LoadLoraAdapter(*loaded, dir);
    ASSERT_TRUE(s.ok()) << targets << ": " << s;
    EXPECT_EQ(Loss(*loaded, batch), Loss(*source, batch)) << targets;
    // Into a model whose LoRA lists the same modules in another order.
    auto on = Base("tiny");
    LoraOptions o = Options(*on, 3, 0);
    std::reverse(o.targets.begin(), o.targets.end());
    ASSERT_TRUE(EnableLora(*on, o).ok());
    s = LoadLoraAdapter(*on, dir);
    ASSERT_TRUE(s.ok()) << targets << ": " << s;
    EXPECT_EQ(Loss(*on, batch), Loss(*source, batch)) << targets;
  }
  // Paths of only some layers: refused, naming what is missing.
  config["target_modules"] = {"model.layers.0.self_attn.q_proj"};
  WriteBytes(config_path, config.dump());
  auto m = Base("tiny");
  absl::Status s = LoadLoraAdapter(*m, dir);
  EXPECT_NE(s.message().find("is no LoRA adapter of this model's target modules"), std::string::npos) << s;
  // Mamba adapters with modules PEFT refuses or ignores.
  auto ssm = WithLora("tiny-ssm", 2);
  ASSERT_TRUE(SaveLoraAdapter(*ssm, dir, "tiny-ssm").ok());
  const std::string ssm_config = ReadBytes(config_path);
  for (const char* module : {"out_proj", "dt_proj"}) {
    config = nlohmann::json::parse(ssm_config);
    config["target_modules"].push_back(module);
    WriteBytes(config_path, config.dump());
    auto base = Base("tiny-ssm");
    s = LoadLoraAdapter(*base, dir);
    EXPECT_NE(s.message().find(absl::StrCat("adapter_config.json: target_modules: '", module, "' is not supported")),
              std::string::npos)
        << s;
  }
}

TEST(LoraFilesTest, BadAdapters) {
  auto source = WithLora("tiny", 3);
  const std::string good = TempDir("adapter_good");
  ASSERT_TRUE(SaveLoraAdapter(*source, good, "tiny").ok());
  auto load_error = [](Model& m, const std::string& dir) {
    absl::Status s = LoadLoraAdapter(m, dir);
    EXPECT_FALSE(s.ok()) << dir;
    return std::string(s.message());
  };
  auto copy = [&](const std::string& name) {
    const std::string dir = TempDir(name);
    mkdir(dir.c_str(), 0755);
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"})
      WriteBytes(dir + "/" + f, ReadBytes(good + "/" + f));
    return dir;
  };

  // A different base model: tiny-qwen2 has one KV head (k_proj / v_proj are [8, 32], not [16, 32]) and 2 layers.
  {
    auto other = Base("tiny-qwen2");
    const std::string e = load_error(*other, good);
    EXPECT_NE(e.find("adapter_model.safetensors: tensor 'base_model.model.model.layers."), std::string::npos) << e;
    EXPECT_TRUE(e.find("has shape [16, 3] but this model needs [8, 3]") != std::string::npos ||
                e.find("is no LoRA adapter of this model") != std::string::npos)
        << e;
    EXPECT_EQ(other->lora(), nullptr) << "a failed load must not enable LoRA";
  }
  {  // only the shapes differ: a tiny config with wider MLP
    TransformerConfig c = *TransformerPreset("tiny");
    c.intermediate_size = 40;
    auto other = CreateTransformer(c, DType::kF64);
    const std::string e = load_error(**other, good);
    EXPECT_NE(e.find("mlp."), std::string::npos) << e;
    EXPECT_NE(e.find("but this model needs"), std::string::npos) << e;
    EXPECT_NE(e.find("[48, 3]"), std::string::npos) << e;
    EXPECT_NE(e.find("[40, 3]"), std::string::npos) << e;
  }
  {  // a Mamba adapter on a Llama
    auto ssm = WithLora("tiny-ssm", 2);
    const std::string dir = TempDir("adapter_ssm");
    ASSERT_TRUE(SaveLoraAdapter(*ssm, dir, "tiny-ssm").ok());
    auto llama = Base("tiny");
    const std::string e = load_error(*llama, dir);
    EXPECT_NE(e.find("adapter_config.json: target_modules: 'x_proj' is not a linear module"), std::string::npos) << e;
  }
  {  // the model's LoRA differs from the file's
    auto other = Base("tiny");
    ASSERT_TRUE(EnableLora(*other, Options(*other, 5, 0)).ok());
    const std::string e = load_error(*other, good);
    EXPECT_NE(e.find("r 3 vs 5"), std::string::npos) << e;
  }
  {  // truncated weights
    const std::string dir = copy("adapter_truncated");
    const std::string bytes = ReadBytes(dir + "/adapter_model.safetensors");
    WriteBytes(dir + "/adapter_model.safetensors", bytes.substr(0, bytes.size() - 100));
    auto m = Base("tiny");
    const std::string e = load_error(*m, dir);
    EXPECT_NE(e.find(dir + "/adapter_model.safetensors"), std::string::npos) << e;
    EXPECT_EQ(m->lora(), nullptr);
  }
  {  // garbage header
    const std::string dir = copy("adapter_garbage");
    WriteBytes(dir + "/adapter_model.safetensors", "not a safetensors file at all");
    auto m = Base("tiny");
    EXPECT_NE(load_error(*m, dir).find(dir + "/adapter_model.safetensors"), std::string::npos);
  }
  {  // truncated / invalid JSON, missing files, unsupported features
    const std::string dir = copy("adapter_badjson");
    const std::string json = ReadBytes(dir + "/adapter_config.json");
    WriteBytes(dir + "/adapter_config.json", json.substr(0, json.size() / 2));
    auto m = Base("tiny");
    EXPECT_NE(load_error(*m, dir).find(dir + "/adapter_config.json"), std::string::npos);
    std::remove((dir + "/adapter_config.json").c_str());
    EXPECT_NE(load_error(*m, dir).find(dir + "/adapter_config.json"), std::string::npos);
    const std::string dir2 = copy("adapter_noweights");
    std::remove((dir2 + "/adapter_model.safetensors").c_str());
    EXPECT_NE(load_error(*m, dir2).find(dir2 + "/adapter_model.safetensors"), std::string::npos);
    for (const auto& [from, to, what] : std::vector<std::tuple<std::string, std::string, std::string>>{
             {"\"bias\": \"none\"", "\"bias\": \"all\"", "field 'bias' is 'all'"},
             {"\"use_dora\": false", "\"use_dora\": true", "field 'use_dora' is true"},
             {"\"init_lora_weights\": true", "\"init_lora_weights\": \"pissa\"",
              "field 'init_lora_weights' is \"pissa\": only the plain initialisations"},
             {"\"init_lora_weights\": true", "\"init_lora_weights\": \"olora\"",
              "field 'init_lora_weights' is \"olora\""},
             {"\"init_lora_weights\": true", "\"init_lora_weights\": \"pissa_niter_4\"", "is \"pissa_niter_4\""},
             {"\"target_modules\": [", "\"target_modules\": \"q_proj|v_proj\", \"x\": [",
              "field 'target_modules' is the regular expression 'q_proj|v_proj'"},
             {"\"peft_type\": \"LORA\"", "\"peft_type\": \"IA3\"", "only LORA adapters"},
             {"\"r\": 3", "\"r\": 0", "field 'r' must be a positive integer"},
             {"\"lora_dropout\": 0.0", "\"lora_dropout\": 1.5", "field 'lora_dropout'"}}) {
      const std::string d = copy("adapter_field");
      std::string text = ReadBytes(d + "/adapter_config.json");
      const size_t at = text.find(from);
      ASSERT_NE(at, std::string::npos) << from << " in " << text;
      text.replace(at, from.size(), to);
      WriteBytes(d + "/adapter_config.json", text);
      const std::string e = load_error(*m, d);
      EXPECT_NE(e.find(what), std::string::npos) << e;
    }
    EXPECT_EQ(m->lora(), nullptr);
  }
  {  // a missing adapter tensor and a foreign one
    const std::string dir = copy("adapter_missing");
    absl::StatusOr<io::SafetensorsFile> file = io::SafetensorsFile::Open(good + "/adapter_model.safetensors");
    std::vector<io::TensorToWrite> tensors;
    std::vector<std::vector<double>> data;
    data.reserve(file->tensors().size());
    for (const io::TensorInfo& t : file->tensors()) {
      if (t.name.find("layers.2.mlp.down_proj.lora_B") != std::string::npos) continue;
      data.emplace_back(t.numel);
      ASSERT_TRUE(file->ReadAs(t.name, DType::kF64, data.back().data(), t.numel).ok());
      tensors.push_back({t.name, DType::kF64, t.shape, data.back().data()});
    }
    ASSERT_TRUE(io::WriteSafetensors(dir + "/adapter_model.safetensors", tensors).ok());
    auto m = Base("tiny");
    std::string e = load_error(*m, dir);
    EXPECT_NE(e.find("1 adapter tensor is missing: base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"),
              std::string::npos)
        << e;
    std::vector<double> extra(3 * 32);
    tensors.push_back(
        {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", DType::kF64, {3, 32}, extra.data()});
    ASSERT_TRUE(io::WriteSafetensors(dir + "/adapter_model.safetensors", tensors).ok());
    e = load_error(*m, dir);
    EXPECT_NE(e.find("tensor 'base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight' [3, 32] is no LoRA "
                     "adapter of this model"),
              std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace sg
