// Trainer::TokenLogprobs (the C API's sg_trainer_score) against a full-sequence forward whose final norm, logits and
// log-softmax are computed here in f64, outside the engine's chunked LM head.
#include "core/trainer.h"

#include <cblas.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/model_io.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"

namespace sg {
namespace {

struct Family {
  std::unique_ptr<Model> model;
  std::string norm, head;  // parameter names of the final norm and the LM head
  double eps = 0;
};

Family MakeFamily(const std::string& family) {
  Family f;
  f.model = std::move(*LoadAnyModel(family == "transformer" ? "tiny" : "tiny-ssm", DType::kF64, /*seed=*/5));
  if (auto* t = dynamic_cast<TransformerModel*>(f.model.get())) {
    f.norm = "model.norm.weight";
    f.head = t->config().tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    f.eps = t->config().rms_norm_eps;
  } else {
    const MambaConfig& c = dynamic_cast<MambaModel&>(*f.model).config();
    f.norm = "backbone.norm_f.weight";
    f.head = c.tie_word_embeddings ? "backbone.embeddings.weight" : "lm_head.weight";
    f.eps = c.layer_norm_epsilon;
  }
  return f;
}

const double* ParamData(Model& m, const std::string& name) {
  for (const Param& p : m.params())
    if (p.name == name) return p.value.data<double>();
  ADD_FAILURE() << "no parameter " << name;
  return nullptr;
}

// Per position, log softmax(head · rmsnorm(h_t))[label_t] of one forward over the whole sequence (NaN where the
// label is ignored).
std::vector<double> FullLogprobs(Family& f, const Sequence& s) {
  Model& m = *f.model;
  const int64_t T = static_cast<int64_t>(s.ids.size()), d = m.hidden_size(), V = m.vocab_size();
  const Chunk all{0, T};
  auto state = m.NewState(StateOptions{T, 4, m.num_layers(), 1});
  Tensor x = m.Embed(s.ids.data(), all);
  for (int l = 0; l < m.num_layers(); ++l) x = m.LayerForward(l, all, x, *state, nullptr);
  const double *h = x.data<double>(), *w = ParamData(m, f.norm), *head = ParamData(m, f.head);
  std::vector<double> out(T, NAN), hn(d), logits(V);
  for (int64_t t = 0; t < T; ++t) {
    if (s.labels[t] < 0) continue;
    double ss = 0;
    for (int64_t k = 0; k < d; ++k) ss += h[t * d + k] * h[t * d + k];
    const double r = 1 / std::sqrt(ss / static_cast<double>(d) + f.eps);
    for (int64_t k = 0; k < d; ++k) hn[k] = h[t * d + k] * r * w[k];
    double top = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      double z = 0;
      for (int64_t k = 0; k < d; ++k) z += hn[k] * head[v * d + k];
      logits[v] = z;
      top = std::max(top, z);
    }
    double sum = 0;
    for (double z : logits) sum += std::exp(z - top);
    out[t] = logits[s.labels[t]] - top - std::log(sum);
  }
  return out;
}

class TokenLogprobsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenLogprobsTest, MatchesFullSequenceLogSoftmaxAtEveryChunkSize) {
  Family f = MakeFamily(GetParam());
  Model& m = *f.model;
  Sequence s;
  uint64_t x = 12345;
  for (int64_t t = 0; t < 37; ++t) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s.ids.push_back(static_cast<int32_t>((x >> 33) % m.vocab_size()));
    s.labels.push_back(t % 6 == 4 ? -100 : static_cast<int32_t>((x >> 13) % m.vocab_size()));
  }
  const std::vector<double> want = FullLogprobs(f, s);
  for (int64_t chunk : {1, 5, 16, 37}) {
    for (int64_t lm_chunk : {1, 7, 256}) {
      StrategyOptions o;
      o.name = GetParam() == "ssm" ? "full" : "seco";
      o.chunk = chunk;
      o.page_size = 4;
      o.lm_chunk = lm_chunk;
      Trainer trainer(m, o, OptimizerOptions{});
      absl::StatusOr<std::vector<double>> got = trainer.TokenLogprobs(m, s);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), want.size());
      for (size_t t = 0; t < want.size(); ++t) {
        if (std::isnan(want[t])) {
          EXPECT_TRUE(std::isnan((*got)[t])) << "position " << t;
          continue;
        }
        EXPECT_NEAR((*got)[t], want[t], 1e-12 * std::max(1.0, std::fabs(want[t])))
            << "position " << t << ", chunk " << chunk << ", lm_chunk " << lm_chunk;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TokenLogprobsTest, ::testing::Values("transformer", "ssm"));

// The C API's num_threads: OpenMP's and OpenBLAS's counts for the scope, on the calling thread only, then restored.
TEST(ScopedThreadsTest, SetsTheCallingThreadsCountsAndRestoresThem) {
  const int before = omp_get_max_threads();
  const int n = before + 2;
  {
    ScopedThreads scoped(n);
    EXPECT_EQ(omp_get_max_threads(), n);
    EXPECT_EQ(openblas_get_num_threads(), n);
    int other = 0;
    std::thread([&] { other = omp_get_max_threads(); }).join();
    EXPECT_NE(other, n);  // another thread keeps its own count
  }
  EXPECT_EQ(omp_get_max_threads(), before);
  EXPECT_EQ(openblas_get_num_threads(), before);
  {
    ScopedThreads none(0);
    EXPECT_EQ(omp_get_max_threads(), before);
  }
  std::unique_ptr<Model> m = std::move(*LoadAnyModel("tiny", DType::kF32, 1));
  Trainer t(*m, StrategyOptions{}, OptimizerOptions{});
  EXPECT_EQ(t.threads(), before);
  t.set_num_threads(n);
  EXPECT_EQ(t.threads(), n);
}

}  // namespace
}  // namespace sg
