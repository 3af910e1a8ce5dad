// Adjoint sharding on the transformer family's Mamba-2 layers (tiny-mamba2, tiny-bamba's attention and SwiGLU MLPs
// beside them, tiny-nemotron-h's ReLU² MLPs), fp64: the full window and the scan form equal full backprop with
// uneven chunks and packed documents; a truncated window counts T̄T - T̄(T̄-1)/2 pairs per layer and head, its
// gradient does not depend on the chunking, and its error shrinks as it grows; the paper's formula is a pure
// Mamba-2 stack's only; models without a scan layer are refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/data.h"
#include "core/gradcheck.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::unique_ptr<TransformerModel> Tiny(const std::string& preset, int64_t layers = 0) {
  absl::StatusOr<TransformerConfig> config = TransformerPreset(preset);
  EXPECT_TRUE(config.ok()) << config.status();
  if (layers > 0) {
    config->num_layers = layers;
    config->mixers.resize(layers);
    config->mlps.resize(layers);
  }
  auto model = CreateTransformer(*config, DType::kF64);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 11;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

int64_t MambaLayers(const std::string& preset) { return TransformerPreset(preset)->mamba_layer_count(); }

StrategyOptions Adjoint(int64_t chunk, int64_t window = StrategyOptions::kNoAdjointWindow,
                        const std::string& form = "pairs") {
  StrategyOptions o;
  o.name = "adjoint";
  o.adjoint_form = form;
  o.adjoint_window = window;
  o.chunk = chunk;
  o.page_size = 4;
  o.lm_chunk = 5;
  return o;
}

// Pairs (t, i), i <= t < i + w, of one layer and head over a document of T tokens (the paper: T̄T - T̄(T̄-1)/2).
int64_t PairsPerLayer(int64_t T, int64_t w) {
  w = std::min(w, T);
  return w * T - w * (w - 1) / 2;
}

// The batch's pairs per layer and head: every document of every sequence.
int64_t Pairs(const std::vector<Sequence>& batch, int64_t window) {
  int64_t pairs = 0;
  for (const Sequence& s : batch) {
    const int64_t T = static_cast<int64_t>(s.ids.size());
    if (s.doc_starts.empty()) pairs += PairsPerLayer(T, window);
    for (size_t d = 0; d < s.doc_starts.size(); ++d)
      pairs += PairsPerLayer((d + 1 < s.doc_starts.size() ? s.doc_starts[d + 1] : T) - s.doc_starts[d], window);
  }
  return pairs;
}

// Lengths 23 and 9 (RaggedBatch); with documents, the 23 tokens packed as documents of 7, 3, 9, 1 and 4 (+ 1 label).
std::vector<Sequence> Batch(int64_t vocab, bool packed) {
  std::vector<Sequence> batch = RaggedBatch(vocab, 999);
  if (packed) {
    EXPECT_TRUE(SetDocuments(batch[0], {7, 3, 9, 1, 4}, "packed").ok());
  }
  return batch;
}

struct Case {
  std::string preset;
  int64_t chunk;
  std::string form = "pairs";
  bool packed = false;
};

class Mamba2AdjointTest : public ::testing::TestWithParam<Case> {};

// Exact: the loss and every gradient as full backprop's; the pairs are all (t, i) of each document.
TEST_P(Mamba2AdjointTest, FullWindowMatchesFullBackprop) {
  const Case& c = GetParam();
  auto model = Tiny(c.preset);
  const std::vector<Sequence> batch = Batch(model->vocab_size(), c.packed);
  absl::StatusOr<GradCheckResult> r =
      CheckAgainstFull(*model, batch, Adjoint(c.chunk, StrategyOptions::kNoAdjointWindow, c.form));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->params_checked, static_cast<int64_t>(model->params().size()));
  EXPECT_NEAR(r->loss, r->reference_loss, 1e-12 * std::abs(r->reference_loss));
  EXPECT_LE(r->max_rel_err, 1e-10) << "worst: " << r->worst_param;
  const int64_t pairs = c.form == "scan" ? 0 : MambaLayers(c.preset) * Pairs(batch, 1 << 30);
  EXPECT_EQ(r->adjoint_pairs, pairs);
}

// Chunks of 1 (shorter than the conv tail), 4 and 7 (uneven), 23 (one chunk); documents cut by chunks of 4 and 5.
INSTANTIATE_TEST_SUITE_P(Exact, Mamba2AdjointTest,
                         ::testing::Values(Case{"tiny-mamba2", 1}, Case{"tiny-mamba2", 7}, Case{"tiny-mamba2", 23},
                                           Case{"tiny-mamba2", 4, "scan"}, Case{"tiny-mamba2", 4, "pairs", true},
                                           Case{"tiny-mamba2", 5, "scan", true}, Case{"tiny-bamba", 2},
                                           Case{"tiny-bamba", 7}, Case{"tiny-bamba", 5, "scan"},
                                           Case{"tiny-bamba", 4, "pairs", true}, Case{"tiny-nemotron-h", 3},
                                           Case{"tiny-nemotron-h", 23}, Case{"tiny-nemotron-h", 5, "pairs", true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.preset.substr(5) + "_chunk" +
                                              std::to_string(info.param.chunk) + "_" + info.param.form +
                                              (info.param.packed ? "_packed" : "");
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The batch gradient of one strategy (every parameter, in order).
std::vector<double> Gradients(Model& model, const std::vector<Sequence>& batch, const StrategyOptions& o,
                              int64_t* pairs = nullptr) {
  Trainer trainer(model, o, {});
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(batch);
  EXPECT_TRUE(m.ok()) << m.status();
  if (pairs && m.ok()) *pairs = m->adjoint_pairs;
  std::vector<double> g;
  for (Param& p : model.params()) g.insert(g.end(), p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
  return g;
}

double RelativeError(const std::vector<double>& got, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) diff += (got[i] - ref[i]) * (got[i] - ref[i]), norm += ref[i] * ref[i];
  return std::sqrt(diff / norm);
}

// A truncated window: chunks of 4 (relaying T̄ - 1 tokens' cotangents across chunk boundaries) give the gradient of
// one chunk per sequence (no relay: the pairs op alone, whose window the kernel tests check against the definition),
// with and without documents; the pairs counted are the paper's; the error against exact shrinks as T̄ grows, and a
// window of the whole sequence is exact.
TEST(Mamba2AdjointTest, TruncatedWindowIsIndependentOfChunks) {
  for (const std::string preset : {"tiny-mamba2", "tiny-bamba"}) {
    for (bool packed : {false, true}) {
      auto model = Tiny(preset);
      const std::vector<Sequence> batch = Batch(model->vocab_size(), packed);
      const std::string what = preset + (packed ? " packed" : "");
      const std::vector<double> exact =
          Gradients(*model, batch, Adjoint(512, StrategyOptions::kNoAdjointWindow, "scan"));
      double previous = INFINITY;
      for (int64_t w : {1, 3, 6, 23}) {
        int64_t pairs = 0;
        const std::vector<double> chunked = Gradients(*model, batch, Adjoint(4, w), &pairs);
        const std::vector<double> whole = Gradients(*model, batch, Adjoint(512, w));
        EXPECT_LE(RelativeError(chunked, whole), 1e-12) << what << " window " << w;
        EXPECT_EQ(pairs, MambaLayers(preset) * Pairs(batch, w)) << what << " window " << w;
        const double error = RelativeError(chunked, exact);
        if (w < 23) {
          EXPECT_GT(error, 1e-6) << what << " window " << w;
          EXPECT_LT(error, previous) << what << " window " << w;
        } else {
          EXPECT_LE(error, 1e-12) << what << " window " << w;
        }
        previous = error;
      }
    }
  }
}

// The paper's multi-layer formula (every layer gets the head's cotangent) on a pure Mamba-2 stack: exact for one
// layer and wrong for more, as on Mamba-1 (../shared/notes/adjoint-sharding.md).
TEST(Mamba2AdjointTest, PaperFormIsExactForOneLayerOnly) {
  for (int64_t layers : {1, 3}) {
    auto model = Tiny("tiny-mamba2", layers);
    absl::StatusOr<GradCheckResult> r = CheckAgainstFull(*model, Batch(model->vocab_size(), false),
                                                         Adjoint(6, StrategyOptions::kNoAdjointWindow, "paper"));
    ASSERT_TRUE(r.ok()) << r.status();
    if (layers == 1)
      EXPECT_LE(r->max_rel_err, 1e-10) << r->worst_param;
    else
      EXPECT_GT(r->max_rel_err, 1e-2) << r->worst_param;
  }
}

// Refused by name, before any work: adjoint on a model without scan layers (Qwen3.5's Gated DeltaNet hybrid and a
// Llama), the paper's formula on a model with attention or MLP layers.
TEST(Mamba2AdjointTest, RefusesModelsItDoesNotFit) {
  auto error = [](const std::string& preset, const std::string& form) {
    auto model = Tiny(preset);
    Trainer trainer(*model, Adjoint(4, StrategyOptions::kNoAdjointWindow, form), {});
    absl::StatusOr<StepMetrics> r = trainer.ComputeGradients(Batch(model->vocab_size(), false));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << preset << " " << form;
    return std::string(r.status().message());
  };
  for (const std::string preset : {"tiny", "tiny-qwen3.5"})
    EXPECT_THAT(error(preset, "pairs"), ::testing::HasSubstr("needs a state-space model")) << preset;
  for (const std::string preset : {"tiny-bamba", "tiny-nemotron-h"})
    EXPECT_THAT(error(preset, "paper"), ::testing::HasSubstr("--adjoint_form=paper")) << preset;
}

}  // namespace
}  // namespace sg
