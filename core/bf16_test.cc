// --dtype=bf16 (param_store.h, optimizer.h): a model whose matrices, KV pages and logits are stored in bf16 computes
// the loss and gradients of an f32 model holding the same (rounded) values to bf16's resolution; those bytes halve;
// trainable bf16 parameters step through fp32 masters (master_weights); LoRA's frozen bf16 base has no fp32 copy; an
// HF checkpoint round-trips in bf16 and saves in f32 on request; the layer inputs ckpt and streambp keep for the
// whole sequence are bf16, and every exact strategy still gives full's gradients. Llama/Qwen2 and Mamba alike.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>

#include "absl/strings/match.h"
#include "core/checkpoint.h"
#include "core/io/safetensors.h"
#include "core/lora.h"
#include "core/model_io.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/optimizer.h"
#include "core/param_store.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

// A preset of either family with random weights (Mamba's scan initialised as HF does).
std::unique_ptr<Model> Make(const std::string& preset, DType dtype) {
  absl::StatusOr<std::unique_ptr<Model>> model = LoadAnyModel(preset, dtype, 5);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 5;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  if (auto* mamba = dynamic_cast<MambaModel*>(model->get())) InitMambaScan(*mamba, 5);
  return std::move(*model);
}

// The f32 model holding exactly the bf16 model's values.
std::unique_ptr<Model> Widened(const std::string& preset, Model& bf16) {
  auto f32 = Make(preset, DType::kF32);
  for (size_t i = 0; i < bf16.params().size(); ++i) {
    const Tensor& src = bf16.params()[i].value;
    float* dst = f32->params()[i].value.data<float>();
    for (int64_t j = 0; j < src.numel(); ++j)
      dst[j] = src.dtype() == DType::kBF16 ? BF16ToF32(src.data<uint16_t>()[j]) : src.data<float>()[j];
  }
  return f32;
}

double MaxRelDiff(const Tensor& a, const Tensor& b) {
  double num = 0, den = 1e-30;
  for (int64_t i = 0; i < a.numel(); ++i) {
    num = std::max<double>(num, std::abs(a.data<float>()[i] - b.data<float>()[i]));
    den = std::max<double>(den, std::abs(b.data<float>()[i]));
  }
  return num / den;
}

int64_t Category(Model& m, MemCategory c) { return m.memory().Snapshot().current[static_cast<int>(c)]; }

// Linear and embedding matrices are bf16; vectors, Mamba's conv filter and A_log (fed to the fp32 conv and scan) f32.
TEST(BF16WeightsTest, MatricesInBF16VectorsAndGradientsInF32) {
  for (const char* preset : {"tiny-qwen2", "tiny-ssm"}) {
    auto m = Make(preset, DType::kBF16);
    EXPECT_EQ(m->dtype(), DType::kF32);  // the compute dtype
    int64_t bytes = 0, f32_bytes = 0;
    for (Param& p : m->params()) {
      const bool matrix =
          p.value.shape().size() >= 2 && !absl::EndsWith(p.name, "conv1d.weight") && !absl::EndsWith(p.name, "A_log");
      EXPECT_EQ(p.value.dtype(), matrix ? DType::kBF16 : DType::kF32) << p.name;
      EXPECT_EQ(p.grad.dtype(), DType::kF32) << p.name;
      bytes += p.value.nbytes();
      f32_bytes += 4 * p.value.numel();
    }
    EXPECT_EQ(Category(*m, MemCategory::kWeights), bytes) << preset;
    // tiny-ssm's fp32 conv filters and A_log are a larger share of its few weights than at real sizes.
    EXPECT_LT(bytes, (m->family() == "ssm" ? 0.6 : 0.52) * f32_bytes) << preset;
  }
}

// The bf16 model differs from the f32 one on the same weights only by its bf16 KV and KV-gradient pages, logits
// chunks, layer outputs and the activations its layers keep: loss and gradients agree to bf16's resolution (the
// accuracy bound against PyTorch is tests/torch_ref/bf16_accuracy_test.py), and the pages and logits take exactly
// half the bytes.
TEST(BF16WeightsTest, CloseToF32OnTheRoundedWeightsWithHalfTheKVAndLogitBytes) {
  for (const std::string preset : {"tiny", "tiny-qwen2"})
    for (const std::string strategy : {"full", "seco", "streambp", "seco offload sparse"}) {
      auto bf16 = Make(preset, DType::kBF16);
      auto f32 = Widened(preset, *bf16);
      StrategyOptions so;
      so.name = strategy.substr(0, strategy.find(' '));
      so.chunk = 5;
      so.page_size = 4;
      so.offload = so.name != strategy;  // KV pages copied to and from the host in bf16
      so.sparse_pages = so.offload ? 1 : 0;
      const std::vector<Sequence> batch = RaggedBatch(bf16->vocab_size(), 3);
      Trainer a(*bf16, so, OptimizerOptions{}), b(*f32, so, OptimizerOptions{});
      absl::StatusOr<StepMetrics> ra = a.ComputeGradients(batch), rb = b.ComputeGradients(batch);
      ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
      const std::string what = preset + " " + strategy;
      EXPECT_NEAR(ra->loss, rb->loss, 1e-2 * std::abs(rb->loss)) << what;
      EXPECT_NE(ra->loss, rb->loss) << what;  // the pages are rounded
      for (size_t i = 0; i < f32->params().size(); ++i) {
        // k_proj's bias shifts every logit of a query by the same amount, which softmax ignores: its true gradient
        // is 0, and what both compute is rounding noise.
        const bool zero_gradient = absl::EndsWith(f32->params()[i].name, "k_proj.bias");
        EXPECT_LE(MaxRelDiff(bf16->params()[i].grad, f32->params()[i].grad), zero_gradient ? 1.5e-1 : 6e-2)
            << what << " " << f32->params()[i].name;
      }
      const MemorySnapshot sa = bf16->memory().Snapshot(), sb = f32->memory().Snapshot();
      // Sparse attention's key sums are f64 in both, in the KV cache's category: per layer, complete page of the
      // longest sequence and KV dimension, 8 bytes (StateBytesPerToken of the f32 model: 2 x 4 per KV dimension and
      // layer).
      int64_t longest = 0;
      for (const Sequence& s : batch) longest = std::max<int64_t>(longest, s.ids.size());
      const int64_t key_sums = so.sparse_pages ? (longest / so.page_size) * f32->StateBytesPerToken() : 0;
      for (MemCategory c : {MemCategory::kKVCache, MemCategory::kKVGrad, MemCategory::kLogits}) {
        const int64_t same = c == MemCategory::kKVCache ? key_sums : 0;
        EXPECT_GT(sb.peak[static_cast<int>(c)], 0) << what;
        EXPECT_EQ(2 * (sa.peak[static_cast<int>(c)] - same), sb.peak[static_cast<int>(c)] - same)
            << what << " " << MemCategoryName(c);
      }
      EXPECT_EQ(2 * bf16->StateBytesPerToken(), f32->StateBytesPerToken());
    }
}

// Mamba: the bf16 matrices are read through gemm_mixed and the scan and conv states stay fp32, so the bf16
// model differs from the f32 one on the same weights only by its bf16 logits chunks, which take half the bytes, and
// its layer outputs and kept activations rounded to bf16.
TEST(BF16WeightsTest, MambaCloseToF32OnTheRoundedWeights) {
  for (const std::string strategy : {"full", "seco", "streambp", "adjoint"}) {
    auto bf16 = Make("tiny-ssm", DType::kBF16);
    auto f32 = Widened("tiny-ssm", *bf16);
    StrategyOptions so;
    so.name = strategy;
    so.chunk = 5;
    const std::vector<Sequence> batch = RaggedBatch(bf16->vocab_size(), 3);
    Trainer a(*bf16, so, OptimizerOptions{}), b(*f32, so, OptimizerOptions{});
    absl::StatusOr<StepMetrics> ra = a.ComputeGradients(batch), rb = b.ComputeGradients(batch);
    ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
    EXPECT_NEAR(ra->loss, rb->loss, 1e-2 * std::abs(rb->loss)) << strategy;
    EXPECT_NE(ra->loss, rb->loss) << strategy;  // the logits and layer outputs are rounded
    for (size_t i = 0; i < f32->params().size(); ++i)
      EXPECT_LE(MaxRelDiff(bf16->params()[i].grad, f32->params()[i].grad), 6e-2)
          << strategy << " " << f32->params()[i].name;
    const MemorySnapshot sa = bf16->memory().Snapshot(), sb = f32->memory().Snapshot();
    const int logits = static_cast<int>(MemCategory::kLogits), state = static_cast<int>(MemCategory::kKVCache);
    EXPECT_EQ(2 * sa.peak[logits], sb.peak[logits]) << strategy;
    EXPECT_EQ(sa.peak[state], sb.peak[state]) << strategy;  // scan states stay fp32
  }
}

// A sequence of n pseudo-random tokens, every one labelled.
Sequence RandomSequence(int64_t n, int64_t vocab) {
  Sequence s;
  uint64_t x = 11;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s.ids.push_back(static_cast<int32_t>((x >> 33) % vocab));
    s.labels.push_back(static_cast<int32_t>((x >> 17) % vocab));
  }
  return s;
}

// The allocator's peak of the activations category over one gradient pass of a sequence of n tokens.
int64_t ActivationPeak(const std::string& preset, DType dtype, const std::string& strategy, int64_t n) {
  auto m = Make(preset, dtype);
  StrategyOptions so;
  so.name = strategy;
  so.chunk = 8;
  so.page_size = 8;
  Trainer t(*m, so, OptimizerOptions{});
  m->memory().ResetPeak();
  absl::StatusOr<StepMetrics> r = t.ComputeGradients({RandomSequence(n, m->vocab_size())});
  EXPECT_TRUE(r.ok()) << r.status();
  return m->memory().Snapshot().peak[static_cast<int>(MemCategory::kActivations)];
}

// Under bf16 the hidden states a strategy keeps for the whole sequence (ckpt's and streambp's layer inputs) and the
// large tensors every layer keeps for its backward (full's for the whole step, a recomputed layer's under the
// chunked strategies) are bf16; only per-row statistics, Mamba's chunk-start states and the f32 gradient rows stay
// f32. full's activations, almost all kept tensors, about halve (the allocator's peak of the category); every
// strategy's shrink.
TEST(BF16ActivationsTest, KeptActivationsHalve) {
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-ssm"})
    for (const std::string strategy : {"full", "ckpt", "streambp", "seco"})
      for (int64_t n : {64, 128}) {
        const int64_t f32 = ActivationPeak(preset, DType::kF32, strategy, n);
        const int64_t bf16 = ActivationPeak(preset, DType::kBF16, strategy, n);
        const double ratio = static_cast<double>(bf16) / static_cast<double>(f32);
        const std::string what = preset + " " + strategy + " T=" + std::to_string(n);
        std::cout << what << ": activations peak f32 " << f32 << " bf16 " << bf16 << " ratio " << ratio << "\n";
        EXPECT_GE(2 * bf16, f32) << what;  // nothing is smaller than bf16
        EXPECT_LE(ratio, strategy == "full" ? 0.6 : 0.9) << what;
      }
}

// Every layer hands on its output rounded to bf16 (param_store.h, Boundary) and rounds what it keeps where it makes
// it, whichever strategy runs it: ckpt's recompute from its bf16 inputs gives full's gradients bit for bit. On
// Mamba the scan's input path (xin, xc, u) is kept in bf16 for the backward but used unrounded by the forward, so a
// chunk's backward recomputes the scan from an f32 start state that full's does not: the exact strategies agree with
// full to about bf16's resolution over the chunk, not f32's. On transformers the chunked strategies round each
// chunk's contribution into the bf16 KV-gradient pages where full rounds once: their gradients differ by that (the
// most on a k_proj bias, whose true gradient nearly cancels), their losses do not.
TEST(BF16ActivationsTest, StrategiesAgreeWithFull) {
  // Not the MoE presets: a chunk's GEMMs round differently from the whole sequence's, and a router's near-tie then
  // picks another expert (a step in the function, not rounding); they are exact in f64 (moe_hf_test).
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-qwen3.5", "tiny-ssm", "tiny-mamba2", "tiny-bamba"}) {
    auto full = Make(preset, DType::kBF16);
    const bool mamba = full->family() == "ssm", scans = full->scan_layers() != Model::ScanLayers::kNone;
    const std::vector<Sequence> batch = RaggedBatch(full->vocab_size(), 3);
    StrategyOptions fo;
    fo.page_size = 4;
    Trainer ft(*full, fo, OptimizerOptions{});
    absl::StatusOr<StepMetrics> rf = ft.ComputeGradients(batch);
    ASSERT_TRUE(rf.ok()) << rf.status();
    for (const std::string strategy : {"ckpt", "streambp", "seco", "adjoint"}) {
      if (strategy == "adjoint" && !scans) continue;
      auto m = Make(preset, DType::kBF16);
      StrategyOptions so;
      so.name = strategy;
      so.chunk = 5;
      so.page_size = 4;
      Trainer t(*m, so, OptimizerOptions{});
      absl::StatusOr<StepMetrics> r = t.ComputeGradients(batch);
      ASSERT_TRUE(r.ok()) << r.status();
      const std::string what = preset + " " + strategy;
      EXPECT_NEAR(r->loss, rf->loss, 1e-6 * std::abs(rf->loss)) << what;
      const double bound = strategy == "ckpt" ? 0 : mamba ? 5e-3 : 4e-2;
      for (size_t i = 0; i < m->params().size(); ++i)
        EXPECT_LE(MaxRelDiff(m->params()[i].grad, full->params()[i].grad), bound) << what << " " << m->params()[i].name;
    }
  }
}

// The backward widens kept bf16 activations for its elementwise ops a row tile at a time: any tile gives the
// gradients of one tile over all rows, bit for bit.
TEST(BF16ActivationsTest, WideningTileByTileChangesNothing) {
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-ssm"}) {
    std::vector<std::vector<float>> grads;
    for (int64_t rows : {int64_t{512}, int64_t{5}}) {
      bf16_widen_rows = rows;
      auto m = Make(preset, DType::kBF16);
      Trainer t(*m, StrategyOptions{}, OptimizerOptions{});
      absl::StatusOr<StepMetrics> r = t.ComputeGradients({RandomSequence(37, m->vocab_size())});
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<float> all;
      for (const Param& p : m->params())
        all.insert(all.end(), p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
      grads.push_back(std::move(all));
    }
    bf16_widen_rows = 512;
    EXPECT_EQ(grads[0], grads[1]) << preset;
  }
}

// Both families: the same storage rules, masters, LoRA and checkpoints.
class BF16FamilyTest : public testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Families, BF16FamilyTest, testing::Values("tiny", "tiny-ssm"));

TEST_P(BF16FamilyTest, FullTrainingStepsFp32MastersAndRoundsIntoWeights) {
  const std::string preset = GetParam();
  auto m = Make(preset, DType::kBF16);
  int64_t state = 0, masters = 0;
  for (Param& p : m->params()) {
    state += (p.value.dtype() == DType::kBF16 ? 3 : 2) * 4 * p.value.numel();
    if (p.value.dtype() == DType::kBF16) masters += 4 * p.value.numel();
  }
  EXPECT_EQ(AdamW::StateBytes(*m), state);
  OptimizerOptions oo;
  oo.lr = 1e-4;  // steps below bf16's resolution for most weights: only the masters hold them
  Trainer t(*m, StrategyOptions{}, oo);
  const std::vector<Sequence> batch = RaggedBatch(m->vocab_size(), 4);
  std::vector<uint16_t> before(m->params()[0].value.data<uint16_t>(),
                               m->params()[0].value.data<uint16_t>() + m->params()[0].value.numel());
  for (int step = 0; step < 2; ++step) ASSERT_TRUE(t.Step(batch).ok());
  EXPECT_EQ(Category(*m, MemCategory::kOptimizer) + Category(*m, MemCategory::kMasterWeights), state);
  EXPECT_EQ(Category(*m, MemCategory::kMasterWeights), masters);  // a master per bf16 matrix, in its own category
  const AdamW& opt = t.optimizer();
  int64_t unchanged = 0, total = 0;
  for (size_t i = 0; i < m->params().size(); ++i) {
    const Param& p = m->params()[i];
    ASSERT_EQ(opt.master()[i].defined(), p.value.dtype() == DType::kBF16) << p.name;
    if (!opt.master()[i].defined()) continue;
    for (int64_t j = 0; j < p.value.numel(); ++j)
      ASSERT_EQ(p.value.data<uint16_t>()[j], F32ToBF16(opt.master()[i].data<float>()[j])) << p.name << " " << j;
  }
  for (int64_t j = 0; j < static_cast<int64_t>(before.size()); ++j, ++total)
    unchanged += before[j] == m->params()[0].value.data<uint16_t>()[j];
  EXPECT_GT(unchanged, 0);
  EXPECT_LT(unchanged, total);
}

TEST_P(BF16FamilyTest, LoraOverAFrozenBF16BaseHasNoFp32Copy) {
  const std::string preset = GetParam();
  auto m = Make(preset, DType::kBF16);
  const int64_t base = Category(*m, MemCategory::kWeights);
  LoraOptions lo;
  lo.rank = 2;
  lo.targets = m->family() == "ssm" ? std::vector<std::string>{"in_proj", "x_proj"}
                                    : std::vector<std::string>{"q_proj", "v_proj"};
  ASSERT_TRUE(EnableLora(*m, lo).ok());
  int64_t adapters = 0;
  for (const LoraAdapter& ad : m->lora()->adapters) {
    for (int idx : {ad.a, ad.b}) {
      EXPECT_EQ(m->params()[idx].value.dtype(), DType::kF32);
      EXPECT_EQ(m->params()[idx].grad.dtype(), DType::kF32);
      adapters += m->params()[idx].value.nbytes();
    }
    EXPECT_EQ(m->params()[ad.weight].value.dtype(), DType::kBF16);
  }
  RandomizeLoraB(*m, 9, 0.1);
  Trainer t(*m, StrategyOptions{}, OptimizerOptions{});
  ASSERT_TRUE(t.Step(RaggedBatch(m->vocab_size(), 5)).ok());
  EXPECT_EQ(Category(*m, MemCategory::kWeights), base + adapters);
  EXPECT_EQ(Category(*m, MemCategory::kOptimizer), 2 * adapters);  // moments of the adapters, no masters
  EXPECT_EQ(Category(*m, MemCategory::kMasterWeights), 0);
  for (const Tensor& master : t.optimizer().master()) EXPECT_FALSE(master.defined());

  // Saved merged, W + (alpha / r) B A rounded once into bf16.
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/bf16_lora_merged_" + preset;
  ASSERT_TRUE(SaveModel(*m, dir).ok());
  absl::StatusOr<std::unique_ptr<Model>> merged = LoadAnyModel(dir, DType::kBF16, 0);
  ASSERT_TRUE(merged.ok()) << merged.status();
  const LoraAdapter& ad = m->lora()->adapters[0];
  const uint16_t* w = m->params()[ad.weight].value.data<uint16_t>();
  const float *a = m->params()[ad.a].value.data<float>(), *b = m->params()[ad.b].value.data<float>();
  const uint16_t* got = (*merged)->params()[ad.weight].value.data<uint16_t>();
  int64_t moved = 0;
  for (int64_t o = 0; o < ad.out; ++o)
    for (int64_t i = 0; i < ad.in; ++i) {
      double ba = 0;
      for (int64_t k = 0; k < lo.rank; ++k) ba += static_cast<double>(b[o * lo.rank + k]) * a[k * ad.in + i];
      const double want = BF16ToF32(w[o * ad.in + i]) + m->lora()->scale() * ba;
      ASSERT_EQ(got[o * ad.in + i], F32ToBF16(static_cast<float>(want))) << o << " " << i;
      moved += got[o * ad.in + i] != w[o * ad.in + i];
    }
  EXPECT_GT(moved, 0);
}

TEST_P(BF16FamilyTest, CheckpointRoundTripsInBF16WithoutAnFp32Copy) {
  const std::string preset = GetParam();
  auto m = Make(preset, DType::kBF16);
  const std::string dir = std::string(getenv("TEST_TMPDIR")) + "/bf16_model_" + preset;
  ASSERT_TRUE(SaveModel(*m, dir).ok());
  absl::StatusOr<std::unique_ptr<Model>> loaded = LoadAnyModel(dir, DType::kBF16, 0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const MemorySnapshot s = (*loaded)->memory().Snapshot();
  EXPECT_EQ(s.peak[static_cast<int>(MemCategory::kWeights)], Category(*m, MemCategory::kWeights));
  for (size_t i = 0; i < m->params().size(); ++i) {
    const Tensor &a = m->params()[i].value, &b = (*loaded)->params()[i].value;
    ASSERT_EQ(a.dtype(), b.dtype());
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << m->params()[i].name;
  }
}

// The dtypes model.safetensors holds, by tensor name, and config.json's text.
std::map<std::string, io::StDType> SavedDTypes(const std::string& dir) {
  absl::StatusOr<io::SafetensorsFile> f = io::SafetensorsFile::Open(dir + "/model.safetensors");
  EXPECT_TRUE(f.ok()) << f.status();
  std::map<std::string, io::StDType> out;
  if (f.ok())
    for (const io::TensorInfo& t : f->tensors()) out[t.name] = t.dtype;
  return out;
}
std::string SavedConfig(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A bf16 model saves bf16 by default (its matrices as stored, config.json labelled bfloat16, for transformers);
// --save_dtype=f32 widens every tensor exactly (config float32), and that file loads back into bf16 bit for bit;
// bf16 is refused for an f32 model, naming the flag.
TEST_P(BF16FamilyTest, SavesBF16ByDefaultAndF32OnRequest) {
  const std::string preset = GetParam(), tmp = std::string(getenv("TEST_TMPDIR")) + "/save_dtype_" + preset;
  auto m = Make(preset, DType::kBF16);
  for (SaveDType as : {SaveDType(), SaveDType(DType::kBF16)}) {
    ASSERT_TRUE(SaveModel(*m, tmp + "_bf16", "", as).ok());
    const std::map<std::string, io::StDType> saved = SavedDTypes(tmp + "_bf16");
    for (Param& p : m->params()) {
      if (!saved.count(p.name)) continue;  // a tied head
      EXPECT_EQ(saved.at(p.name), p.value.dtype() == DType::kBF16 ? io::StDType::kBF16 : io::StDType::kF32) << p.name;
    }
    EXPECT_NE(SavedConfig(tmp + "_bf16").find("\"torch_dtype\": \"bfloat16\""), std::string::npos);
  }
  ASSERT_TRUE(SaveModel(*m, tmp + "_f32", "", DType::kF32).ok());
  for (const auto& [name, dtype] : SavedDTypes(tmp + "_f32")) EXPECT_EQ(dtype, io::StDType::kF32) << name;
  EXPECT_NE(SavedConfig(tmp + "_f32").find("\"torch_dtype\": \"float32\""), std::string::npos);
  absl::StatusOr<std::unique_ptr<Model>> f32 = LoadAnyModel(tmp + "_f32", DType::kF32, 0);
  absl::StatusOr<std::unique_ptr<Model>> back = LoadAnyModel(tmp + "_f32", DType::kBF16, 0);
  ASSERT_TRUE(f32.ok() && back.ok()) << f32.status() << back.status();
  auto widened = Widened(preset, *m);
  for (size_t i = 0; i < m->params().size(); ++i) {
    const Tensor &a = m->params()[i].value, &b = (*back)->params()[i].value;
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << m->params()[i].name;
    EXPECT_EQ(std::memcmp(widened->params()[i].value.raw(), (*f32)->params()[i].value.raw(),
                          widened->params()[i].value.nbytes()),
              0)
        << m->params()[i].name;
  }
  absl::Status refused = SaveModel(*widened, tmp + "_refused", "", DType::kBF16);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("--save_dtype is bf16"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("--dtype=bf16"), std::string::npos) << refused;
  struct stat st;
  EXPECT_NE(stat((tmp + "_refused").c_str(), &st), 0);  // nothing written
  absl::StatusOr<SaveDType> bad = ParseSaveDType("f16");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--save_dtype"), std::string::npos) << bad.status();
}

std::vector<uint16_t> Bits(Model& m) {
  std::vector<uint16_t> out;
  for (Param& p : m.params()) {
    const uint16_t* h = static_cast<const uint16_t*>(p.value.raw());
    out.insert(out.end(), h, h + p.value.nbytes() / 2);
  }
  return out;
}

// A resumed bf16 run continues bit for bit (the fp32 masters are in the checkpoint); a bf16 checkpoint is refused
// by an f32 model, naming --dtype, and the reverse.
TEST(BF16WeightsTest, CheckpointResumesExactlyAndRefusesAnotherDType) {
  const std::string out = std::string(getenv("TEST_TMPDIR")) + "/bf16_ckpt";
  OptimizerOptions oo;
  oo.lr = 1e-4;
  const std::vector<Sequence> batch = RaggedBatch(97, 6);
  auto m = Make("tiny", DType::kBF16);
  Trainer t(*m, StrategyOptions{}, oo);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(t.Step(batch).ok());
  CheckpointMeta meta;
  meta.trainer = t.state();
  meta.run_config = TrainerRunConfig(t);
  absl::StatusOr<std::string> path = SaveCheckpoint(out, t, meta, 0);
  ASSERT_TRUE(path.ok()) << path.status();
  ASSERT_TRUE(t.Step(batch).ok());

  auto r = Make("tiny", DType::kBF16);
  r->params()[0].value.SetZero();  // differs from the checkpoint until loaded
  Trainer rt(*r, StrategyOptions{}, oo);
  absl::StatusOr<CheckpointMeta> loaded = LoadCheckpoint(*path, rt);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(rt.Step(batch).ok());
  EXPECT_EQ(Bits(*r), Bits(*m));

  for (DType other : {DType::kF32, DType::kF64}) {
    auto f = Make("tiny", other);
    Trainer ft(*f, StrategyOptions{}, oo);
    absl::Status s = LoadCheckpoint(*path, ft).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("--dtype"), std::string::npos) << s;
  }
  auto f = Make("tiny", DType::kF32);
  Trainer ft(*f, StrategyOptions{}, oo);
  ASSERT_TRUE(ft.Step(batch).ok());
  meta.trainer = ft.state();
  meta.run_config = TrainerRunConfig(ft);
  absl::StatusOr<std::string> f32_path = SaveCheckpoint(out + "_f32", ft, meta, 0);
  ASSERT_TRUE(f32_path.ok());
  auto b = Make("tiny", DType::kBF16);
  Trainer bt(*b, StrategyOptions{}, oo);
  absl::Status s = LoadCheckpoint(*f32_path, bt).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("--dtype"), std::string::npos) << s;
}

}  // namespace
}  // namespace sg
