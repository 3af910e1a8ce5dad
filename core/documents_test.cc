// Packed documents (Sequence::doc_starts) in fp64: a packed sequence trained by each strategy gives the sum of the
// losses and the gradients of its documents trained one by one with full backprop, with chunks and pages that cut
// documents and documents shorter than a page. Built with SG_CUDA_EMULATED (//core:documents_emulated_cuda_test) the
// models live on Device::kCUDA, the CPU emulation of the CUDA backend (its attention's key_begin).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/data.h"
#include "core/models/transformer/transformer.h"
#include "core/strategy.h"
#include "kernels/census.h"

namespace sg {
namespace {

#ifdef SG_CUDA_EMULATED
constexpr Device kDevice = Device::kCUDA;
#else
constexpr Device kDevice = Device::kCPU;
#endif

std::unique_ptr<Model> Tiny(const std::string& preset, TransformerConfig* config = nullptr) {
  absl::StatusOr<TransformerConfig> c = TransformerPreset(preset);
  EXPECT_TRUE(c.ok()) << c.status();
  if (config) *c = *config;
  auto model = CreateTransformer(*c, DType::kF64, kDevice);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 11;
  init.stddev = 0.3;  // far from uniform attention
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

struct Result {
  double loss = 0;
  int64_t tokens = 0;
  std::vector<std::vector<double>> grads;
};

Result Train(Model& m, const std::vector<Sequence>& seqs, const StrategyOptions& o) {
  ZeroGrads(m);
  absl::StatusOr<StrategyFn> fn = FindStrategy(o.name);
  EXPECT_TRUE(fn.ok()) << fn.status();
  Result r;
  for (const Sequence& s : seqs) {
    const GradResult g = (*fn)(m, s, 1.0, o);
    r.loss += g.loss_sum.value();
    r.tokens += g.tokens;
  }
  for (Param& p : m.params()) r.grads.push_back(HostCopy<double>(p.grad));
  return r;
}

// tokens (the packed sequence's, its last one only a label) as one sequence of documents, and as the documents.
struct Packed {
  Sequence packed;
  std::vector<Sequence> alone;
};

Packed Pack(const std::vector<int64_t>& lengths, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens;
  for (int64_t len : lengths)
    for (int64_t i = 0; i < len; ++i) tokens.push_back(static_cast<int32_t>(rng() % vocab));
  Packed p;
  p.packed.ids.assign(tokens.begin(), tokens.end() - 1);
  p.packed.labels.assign(tokens.begin() + 1, tokens.end());
  EXPECT_TRUE(SetDocuments(p.packed, lengths, "packed").ok());
  int64_t start = 0;
  for (int64_t len : lengths) {
    if (len >= 2) {  // a one-token document has no position
      Sequence s;
      s.ids.assign(tokens.begin() + start, tokens.begin() + start + len - 1);
      s.labels.assign(tokens.begin() + start + 1, tokens.begin() + start + len);
      p.alone.push_back(std::move(s));
    }
    start += len;
  }
  return p;
}

void ExpectSame(const Result& packed, const Result& alone, const std::string& what) {
  EXPECT_EQ(packed.tokens, alone.tokens) << what;
  EXPECT_NEAR(packed.loss, alone.loss, 1e-11 * std::abs(alone.loss)) << what;
  ASSERT_EQ(packed.grads.size(), alone.grads.size());
  double worst = 0;  // per parameter: the largest difference relative to its largest gradient entry
  for (size_t k = 0; k < packed.grads.size(); ++k) {
    double diff = 0, scale = 1e-300;
    for (size_t i = 0; i < packed.grads[k].size(); ++i) {
      diff = std::max(diff, std::abs(packed.grads[k][i] - alone.grads[k][i]));
      scale = std::max(scale, std::abs(alone.grads[k][i]));
    }
    worst = std::max(worst, diff / scale);
  }
  EXPECT_LE(worst, 1e-11) << what;
}

struct Case {
  std::string preset, strategy;
  int64_t chunk, page_size;
};

class DocumentsTest : public ::testing::TestWithParam<Case> {};

// Documents of 7, 3, 9, 2, 1 and 6 tokens (shorter and longer than a page; a one-token last-but-one document).
TEST_P(DocumentsTest, PackedEqualsDocumentsAlone) {
  const Case& c = GetParam();
  auto model = Tiny(c.preset);
  const Packed p = Pack({7, 3, 9, 2, 1, 6}, model->vocab_size(), 5);
  StrategyOptions o;
  o.name = c.strategy;
  o.chunk = c.chunk;
  o.page_size = c.page_size;
  o.lm_chunk = 4;
  if (c.strategy == "spaco") o.spaco_budget = 1 << 20;  // every chunk: exact
  StrategyOptions full = o;
  full.name = "full";
  const Result alone = Train(*model, p.alone, full);
  const Result packed = Train(*model, {p.packed}, o);
  ExpectSame(packed, alone, c.preset + " " + c.strategy);
}

INSTANTIATE_TEST_SUITE_P(Exact, DocumentsTest,
                         ::testing::Values(Case{"tiny", "full", 512, 4}, Case{"tiny-qwen2", "full", 512, 3},
                                           Case{"tiny", "ckpt", 512, 4}, Case{"tiny", "seco", 5, 4},
                                           Case{"tiny", "seco", 4, 8}, Case{"tiny-qwen2", "seco", 3, 2},
                                           Case{"tiny", "spaco", 5, 4}, Case{"tiny", "streambp", 5, 4},
                                           Case{"tiny-qwen2", "streambp", 4, 3}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.preset + "_" + info.param.strategy + "_chunk" +
                                              std::to_string(info.param.chunk) + "_page" +
                                              std::to_string(info.param.page_size);
                           for (char& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

// Dynamic NTK RoPE scales from the longest document (transformers' max position_id + 1), not from the packed
// length: documents of one length, past max_position_embeddings, packed equal each alone.
TEST(DocumentsTest, DynamicRopeScalesFromTheLongestDocument) {
  absl::StatusOr<TransformerConfig> c = TransformerPreset("tiny");
  ASSERT_TRUE(c.ok());
  c->rope_scaling.type = "dynamic";
  c->rope_scaling.factor = 2.0;
  c->max_position_embeddings = 6;
  auto model = Tiny("tiny", &*c);
  const Packed p = Pack({9, 9, 9}, model->vocab_size(), 6);
  EXPECT_EQ(LongestDocument(p.packed.doc_starts, static_cast<int64_t>(p.packed.ids.size())), 9);
  StrategyOptions o;
  o.page_size = 4;
  ExpectSame(Train(*model, {p.packed}, o), Train(*model, p.alone, o), "dynamic rope");
}

// A document sees nothing of the others: with the first document's labels ignored, replacing its tokens changes
// neither the loss nor any gradient, under sparse attention (whose page selection must not spend its budget on, or
// score, another document's pages) and KV offload (streamed in small groups) too.
TEST(DocumentsTest, OtherDocumentsChangeNothing) {
  auto model = Tiny("tiny");
  auto run = [&](uint64_t first_seed, const StrategyOptions& o) {
    Packed p = Pack({40, 45}, model->vocab_size(), 9);
    std::mt19937_64 rng(first_seed);
    for (int64_t i = 0; i < 39; ++i) p.packed.ids[i] = static_cast<int32_t>(rng() % model->vocab_size());
    for (int64_t i = 0; i < 40; ++i) p.packed.labels[i] = -100;
    return Train(*model, {p.packed}, o);
  };
  StrategyOptions sparse;
  sparse.name = "seco";
  sparse.chunk = 8;
  sparse.page_size = 4;
  sparse.sparse_pages = 2;
  StrategyOptions offload = sparse;
  offload.sparse_pages = 0;
  offload.offload = true;
  offload.attention_group = 8;  // two pages a group: the second document's earlier pages stream through
  StrategyOptions both = sparse;
  both.offload = true;
  for (const StrategyOptions& o : {sparse, offload, both}) {
    SCOPED_TRACE(std::to_string(o.sparse_pages) + " " + std::to_string(o.offload));
    const Result a = run(1, o), b = run(2, o);
    EXPECT_GT(a.tokens, 0);
    ExpectSame(a, b, "sparse " + std::to_string(o.sparse_pages) + " offload " + std::to_string(o.offload));
  }
}

// Attention computes only (query, key) pairs of one document: counted by the census over the CPU table, for full
// backprop (each pair once forward) and seco (chunks cutting documents: a state-building forward and a recompute).
TEST(DocumentsTest, AttentionPairsAreThoseInsideDocuments) {
  const absl::StatusOr<TransformerConfig> c = TransformerPreset("tiny");
  ASSERT_TRUE(c.ok());
  const Packed p = Pack({7, 3, 9, 2, 1, 6}, c->vocab_size, 5);
  int64_t pairs = 0;  // positions of each document (the last token of the sequence is only a label)
  const int64_t n = static_cast<int64_t>(p.packed.ids.size());
  for (size_t d = 0; d < p.packed.doc_starts.size(); ++d) {
    const int64_t end = d + 1 < p.packed.doc_starts.size() ? p.packed.doc_starts[d + 1] : n;
    const int64_t m = end - p.packed.doc_starts[d];
    pairs += m * (m + 1) / 2;
  }
  const int64_t per_pair = 4 * c->head_dim * c->num_heads;  // QK^T and PV, 2 flops a product, a layer
  auto forward_pairs = [&](const StrategyOptions& o) {
    OpCensus census;
    CensusScope scope(Device::kCPU, &census);  // before the model: it binds the counting table when created
    auto model = Tiny("tiny");
    Train(*model, {p.packed}, o);
    const int64_t flops = census.family(OpFamily::kAttentionForward).flops;
    EXPECT_EQ(flops % per_pair, 0);
    return flops / per_pair;
  };
  StrategyOptions full;
  full.page_size = 4;
  EXPECT_EQ(forward_pairs(full), pairs * c->num_layers);
  StrategyOptions seco = full;
  seco.name = "seco";
  seco.chunk = 5;
  EXPECT_LT(forward_pairs(seco), 2 * pairs * c->num_layers);  // at most twice each pair: no others
}

// Bad documents are refused naming the problem.
TEST(DocumentsTest, BadDocumentsAreRefused) {
  Sequence s;
  s.ids = {1, 2, 3, 4};
  s.labels = {2, 3, 4, 5};
  EXPECT_FALSE(SetDocuments(s, {2, 2}, "x").ok());  // sums to 4 tokens, not 5
  EXPECT_FALSE(SetDocuments(s, {5, 0}, "x").ok());
  ASSERT_TRUE(SetDocuments(s, {2, 3}, "x").ok());
  EXPECT_EQ(s.doc_starts, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(s.labels[1], -100);
  EXPECT_TRUE(ValidateSequence(s, 10, "x").ok());
  s.labels[1] = 3;
  absl::Status crossing = ValidateSequence(s, 10, "seq 0");
  EXPECT_NE(crossing.message().find("crosses into document 1"), absl::string_view::npos) << crossing;
  s.labels[1] = -100;
  s.doc_starts = {0, 4};
  EXPECT_FALSE(ValidateSequence(s, 10, "x").ok());
  s.doc_starts = {1};
  EXPECT_FALSE(ValidateSequence(s, 10, "x").ok());
}

}  // namespace
}  // namespace sg
