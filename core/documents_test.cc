// Packed documents (Sequence::doc_starts) in fp64: a packed sequence trained by each strategy gives the sum of the
// losses and the gradients of its documents trained one by one with full backprop, with chunks and pages that cut
// documents and documents shorter than a page; for Mamba, every adjoint form and window too. Built with
// SG_CUDA_EMULATED (//core:documents_emulated_cuda_test) the transformers live on Device::kCUDA, the CPU emulation
// of the CUDA backend (its attention's key_begin).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/data.h"
#include "core/lora.h"
#include "core/models/mamba/mamba.h"
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

template <typename M>
std::unique_ptr<Model> Randomized(absl::StatusOr<std::unique_ptr<M>> model) {
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 11;
  init.stddev = 0.3;  // far from uniform attention
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  return std::move(*model);
}

std::unique_ptr<Model> Tiny(const std::string& preset, TransformerConfig* config = nullptr) {
  absl::StatusOr<TransformerConfig> c = TransformerPreset(preset);
  EXPECT_TRUE(c.ok()) << c.status();
  if (config) *c = *config;
  return Randomized(CreateTransformer(*c, DType::kF64, kDevice));
}

struct Result {
  double loss = 0;
  int64_t tokens = 0, adjoint_pairs = 0;
  std::vector<std::vector<double>> grads;  // empty for a frozen parameter
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
    r.adjoint_pairs += g.adjoint_pairs;
  }
  for (Param& p : m.params()) r.grads.push_back(p.grad.defined() ? HostCopy<double>(p.grad) : std::vector<double>{});
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

// The options both families' cases share: the LM head 4 rows at a time, spaco keeping every chunk (exact).
StrategyOptions Options(const std::string& strategy, int64_t chunk) {
  StrategyOptions o;
  o.name = strategy;
  o.chunk = chunk;
  o.lm_chunk = 4;
  if (strategy == "spaco") o.spaco_budget = 1 << 20;
  return o;
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
  StrategyOptions o = Options(c.strategy, c.chunk);
  o.page_size = c.page_size;
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

// Mamba (Mamba-2's seq_idx semantics): the conv and the scan restart from zeros at every document start and no
// gradient crosses one, whichever strategy, chunking and adjoint form; adjoint sharding's pairs (t, i) stay inside a
// document. Forms that are not exact (a window, the paper's formula on more than one layer) are checked against
// the documents alone under the same options.
struct SsmCase {
  std::string strategy;
  int64_t chunk;
  std::string form = "pairs";
  int64_t window = StrategyOptions::kNoAdjointWindow;
  int64_t layers = 3;
};

class MambaDocumentsTest : public ::testing::TestWithParam<SsmCase> {};

std::string SsmCaseName(const ::testing::TestParamInfo<SsmCase>& info) {
  const SsmCase& c = info.param;
  std::string name = c.strategy + "_chunk" + std::to_string(c.chunk);
  if (c.strategy == "adjoint") name += "_" + c.form + "_layers" + std::to_string(c.layers);
  if (c.window != StrategyOptions::kNoAdjointWindow) name += "_window" + std::to_string(c.window);
  return name;
}

std::unique_ptr<Model> TinySsm(int64_t layers) {
  MambaConfig config = *MambaPreset("tiny-ssm");
  config.num_layers = layers;
  return Randomized(CreateMamba(config, DType::kF64));
}

// The pairs (t, i), i <= t < i + window, of one layer and channel with i and t in one document of s.
int64_t PairsWithinDocuments(const Sequence& s, int64_t window) {
  int64_t pairs = 0;
  for (size_t d = 0; d < s.doc_starts.size(); ++d) {
    const int64_t end = d + 1 < s.doc_starts.size() ? s.doc_starts[d + 1] : static_cast<int64_t>(s.ids.size());
    for (int64_t i = s.doc_starts[d]; i < end; ++i) pairs += std::min(end - i, window);
  }
  return pairs;
}

// Documents of 7, 3, 9, 2, 1 and 6 tokens, as the transformers'.
TEST_P(MambaDocumentsTest, PackedEqualsDocumentsAlone) {
  const SsmCase& c = GetParam();
  auto model = TinySsm(c.layers);
  const Packed p = Pack({7, 3, 9, 2, 1, 6}, model->vocab_size(), 5);
  StrategyOptions o = Options(c.strategy, c.chunk);
  o.adjoint_form = c.form;
  o.adjoint_window = c.window;
  const bool exact = c.window == StrategyOptions::kNoAdjointWindow && (c.form != "paper" || c.layers == 1);
  StrategyOptions reference = o;
  if (exact) reference.name = "full";
  const Result alone = Train(*model, p.alone, reference);
  const Result packed = Train(*model, {p.packed}, o);
  const std::string what = c.strategy + " " + c.form + " chunk " + std::to_string(c.chunk);
  ExpectSame(packed, alone, what);
  if (c.strategy == "adjoint" && c.form != "scan") {
    EXPECT_EQ(packed.adjoint_pairs, c.layers * PairsWithinDocuments(p.packed, c.window)) << what;
  }
}

// Chunks of 1 to 5 cut documents, start at document starts (10, 21) and hold several (20-24: 20, 21 and 22-24, a
// one-token document with no label among them); windows shorter and longer than a chunk.
INSTANTIATE_TEST_SUITE_P(Exact, MambaDocumentsTest,
                         ::testing::Values(SsmCase{"full", 512}, SsmCase{"ckpt", 512}, SsmCase{"seco", 1},
                                           SsmCase{"seco", 3}, SsmCase{"seco", 4}, SsmCase{"spaco", 5},
                                           SsmCase{"streambp", 3}, SsmCase{"streambp", 4}, SsmCase{"adjoint", 1},
                                           SsmCase{"adjoint", 4}, SsmCase{"adjoint", 5}, SsmCase{"adjoint", 3, "scan"},
                                           SsmCase{"adjoint", 4, "paper", StrategyOptions::kNoAdjointWindow, 1}),
                         SsmCaseName);
INSTANTIATE_TEST_SUITE_P(Truncated, MambaDocumentsTest,
                         ::testing::Values(SsmCase{"adjoint", 4, "pairs", 3}, SsmCase{"adjoint", 2, "pairs", 1},
                                           SsmCase{"adjoint", 3, "pairs", 5}, SsmCase{"adjoint", 5, "paper"},
                                           SsmCase{"adjoint", 4, "paper", 2}),
                         SsmCaseName);

// LoRA adapters on every module of the family (dropout off: its masks follow positions, which packing moves): the
// adapters' gradients too, for each strategy against full backprop on the documents alone.
void ExpectLoraPackedEqualsDocumentsAlone(Model& model, const std::vector<std::string>& strategies) {
  LoraOptions lora;
  lora.rank = 2;
  lora.alpha = 4;
  lora.seed = 3;
  lora.targets = LoraTargetModules(model.family());
  ASSERT_TRUE(EnableLora(model, lora).ok());
  RandomizeLoraB(model, 5, 0.3);
  const Packed p = Pack({7, 3, 9, 2, 1, 6}, model.vocab_size(), 7);
  for (const std::string& strategy : strategies)
    ExpectSame(Train(model, {p.packed}, Options(strategy, 4)), Train(model, p.alone, Options("full", 512)),
               "lora " + strategy);
}

TEST(MambaDocumentsTest, LoraPackedEqualsDocumentsAlone) {
  ExpectLoraPackedEqualsDocumentsAlone(*TinySsm(2), {"seco"});
}

TEST(DocumentsTest, LoraPackedEqualsDocumentsAlone) {
  ExpectLoraPackedEqualsDocumentsAlone(*Tiny("tiny"), {"seco", "streambp"});
}

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
    CensusScope scope(kDevice, &census);  // before the model: it binds the counting table when created
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
