// The engine on the GPU: the tiny transformer and Mamba presets placed on Device::kCUDA with the same weights as on
// the CPU; every exact strategy's gradients on the GPU against full backprop on the GPU, and the GPU's against the
// CPU's (f32 and f64). Skipped ("no usable CUDA device: ...") without a GPU, where instead creating a model on the
// GPU must be refused with FailedPrecondition naming the device.
//
// SG_STRATEGY_TEST_DEVICE=cpu runs the GPU side on the CPU (a check of the test itself on a machine without a GPU).
//
// Built with SG_CUDA_EMULATED (//core:cuda_strategy_emulated_test) it runs against the CPU emulation of the CUDA
// backend (kernels/cuda/emulation), where device memory is not host-addressable (a stray host access faults), and
// adds what only the emulator can do: inject a kernel fault, and a device small enough to run out of.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <type_traits>
#include <vector>

#include "core/checkpoint.h"
#include "core/data.h"
#include "core/lora.h"
#include "core/model_io.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/test_batches.h"
#include "core/trainer.h"
#include "kernels/backend.h"

#ifdef SG_CUDA_EMULATED
#include "sg_emu.h"
#endif

namespace sg {
namespace {

bool SelfCheck() {
  const char* e = std::getenv("SG_STRATEGY_TEST_DEVICE");
  return e != nullptr && std::string(e) == "cpu";
}
Device Gpu() { return SelfCheck() ? Device::kCPU : Device::kCUDA; }

std::string SkipMessage(const std::string& why) {
  const std::string prefix = "no usable CUDA device: ";
  return why.compare(0, prefix.size(), prefix) == 0 ? why : prefix + why;
}

// Built with --config=cuda and //kernels/cuda linked in: the backend must be registered (its static registrar kept
// by the linker); then the tests skip only when no GPU is usable.
#define SG_REQUIRE_BACKEND()                                                                          \
  do {                                                                                                \
    if (FindBackend(Device::kCUDA) == nullptr)                                                        \
      FAIL() << "the CUDA backend did not register although //kernels/cuda is linked in (its static " \
                "registrar was dropped by the linker: the cuda_library archive needs alwayslink): "   \
             << DeviceUnavailableReason(Device::kCUDA);                                               \
  } while (0)

#define SG_SKIP_WITHOUT_GPU()                                          \
  do {                                                                 \
    if (SelfCheck()) break;                                            \
    SG_REQUIRE_BACKEND();                                              \
    const std::string sg_why = DeviceUnavailableReason(Device::kCUDA); \
    if (!sg_why.empty()) GTEST_SKIP() << SkipMessage(sg_why);          \
  } while (0)

class CudaStrategyTest : public ::testing::Test {
 protected:
  void SetUp() override { SG_SKIP_WITHOUT_GPU(); }
};

InitOptions Init(uint64_t seed) {
  InitOptions init;
  init.seed = seed;
  init.stddev = 0.3;  // attention far from uniform, as in strategy_test
  init.perturb_norms_and_biases = true;
  return init;
}

// to's parameter values := from's (through host copies: device memory is not host-addressable).
void CopyWeights(Model& from, Model& to) {
  ASSERT_EQ(from.params().size(), to.params().size());
  for (size_t i = 0; i < from.params().size(); ++i) {
    const Param& a = from.params()[i];
    Param& b = to.params()[i];
    ASSERT_EQ(a.name, b.name);
    ASSERT_EQ(a.value.dtype(), b.value.dtype()) << a.name;
    ASSERT_EQ(a.value.numel(), b.value.numel()) << a.name;
    std::vector<char> host(a.value.nbytes());
    CopyToHost(a.value, host.data());
    CopyFromHost(b.value, host.data());
  }
}

// A pair of models with identical weights: one on the CPU, one on the GPU.
struct Pair {
  std::unique_ptr<Model> cpu, gpu;
};

Pair Transformers(const std::string& preset, DType dtype) {
  Pair p;
  absl::StatusOr<TransformerConfig> config = TransformerPreset(preset);
  EXPECT_TRUE(config.ok()) << config.status();
  auto cpu = CreateTransformer(*config, dtype, Device::kCPU);
  auto gpu = CreateTransformer(*config, dtype, Gpu());
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!cpu.ok() || !gpu.ok()) return p;
  p.cpu = std::move(*cpu);
  p.gpu = std::move(*gpu);
  InitRandom(*p.cpu, Init(7));
  CopyWeights(*p.cpu, *p.gpu);
  return p;
}

Pair Mambas(DType dtype) {
  Pair p;
  absl::StatusOr<MambaConfig> config = MambaPreset("tiny-ssm");
  EXPECT_TRUE(config.ok()) << config.status();
  auto cpu = CreateMamba(*config, dtype, Device::kCPU);
  auto gpu = CreateMamba(*config, dtype, Gpu());
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!cpu.ok() || !gpu.ok()) return p;
  p.cpu = std::move(*cpu);
  p.gpu = std::move(*gpu);
  InitRandom(*p.cpu, Init(11));
  CopyWeights(*p.cpu, *p.gpu);
  return p;
}

struct Grads {
  double loss = 0;
  std::vector<std::string> names;
  std::vector<std::vector<double>> g;
};

// The batch gradient of one strategy (the model's gradients are zeroed first by the Trainer).
Grads Gradients(Model& model, const StrategyOptions& o, const std::vector<Sequence>& batch) {
  Grads out;
  Trainer trainer(model, o, {});
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(batch);
  EXPECT_TRUE(m.ok()) << o.name << ": " << m.status();
  if (!m.ok()) return out;
  out.loss = m->loss;
  for (Param& p : model.params()) {
    out.names.push_back(p.name);
    std::vector<double> g;
    if (p.grad.defined() && model.dtype() == DType::kF64)
      g = HostCopy<double>(p.grad);
    else if (p.grad.defined())
      for (float x : HostCopy<float>(p.grad)) g.push_back(x);
    out.g.push_back(std::move(g));
  }
  return out;
}

// Per parameter ||g - ref||_2 / ||ref||_2 (||g||_2 where ref is all zero), and the loss, within tol; returns the
// worst of these errors.
double ExpectClose(const Grads& got, const Grads& ref, double tol, const std::string& what) {
  EXPECT_EQ(got.g.size(), ref.g.size()) << what;
  EXPECT_FALSE(ref.g.empty()) << what;
  if (got.g.size() != ref.g.size() || ref.g.empty()) return INFINITY;
  EXPECT_NEAR(got.loss, ref.loss, tol * std::abs(ref.loss)) << what << ": loss";
  double worst = 0;
  std::string worst_name;
  for (size_t k = 0; k < ref.g.size(); ++k) {
    EXPECT_EQ(got.g[k].size(), ref.g[k].size()) << what << " " << ref.names[k];
    if (got.g[k].size() != ref.g[k].size()) return INFINITY;
    double diff = 0, norm = 0;
    bool finite = true;
    for (size_t i = 0; i < ref.g[k].size(); ++i) {
      finite = finite && std::isfinite(got.g[k][i]);
      diff += (got.g[k][i] - ref.g[k][i]) * (got.g[k][i] - ref.g[k][i]);
      norm += ref.g[k][i] * ref.g[k][i];
    }
    EXPECT_TRUE(finite) << what << ": non-finite gradient of " << ref.names[k];
    const double err = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    EXPECT_LE(err, tol) << what << ": gradient of " << ref.names[k] << " off by " << err << " (relative, 2-norm)";
    if (err > worst) worst = err, worst_name = ref.names[k];
  }
  std::cout << what << ": worst relative gradient error " << worst << " (" << worst_name << "), loss " << got.loss
            << " vs " << ref.loss << "\n";
  return worst;
}

StrategyOptions Strategy(const std::string& name, int64_t chunk, int64_t page_size) {
  StrategyOptions o;
  o.name = name;
  o.chunk = chunk;
  o.page_size = page_size;
  o.lm_chunk = 5;
  return o;
}

// The exact strategies of the transformer family with chunks and pages that do and do not divide the 23- and
// 9-token sequences (small pages: many pages per chunk, chunks that start mid-page).
std::vector<StrategyOptions> TransformerStrategies() {
  return {Strategy("seco", 4, 3),     Strategy("seco", 5, 2),      Strategy("seco", 12, 8),
          Strategy("streambp", 4, 3), Strategy("streambp", 12, 5), Strategy("ckpt", 512, 4)};
}

std::string Describe(const StrategyOptions& o) {
  return o.name + " chunk " + std::to_string(o.chunk) + " page " + std::to_string(o.page_size) +
         (o.sparse_pages ? " sparse " + std::to_string(o.sparse_pages) : "");
}

// f32 on the GPU: every strategy against full backprop on the GPU, and the GPU's full backprop against the CPU's.
TEST_F(CudaStrategyTest, TransformerF32StrategiesMatchFull) {
  Pair p = Transformers("tiny", DType::kF32);
  ASSERT_TRUE(p.gpu && p.cpu);
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 12345);
  const Grads gpu_full = Gradients(*p.gpu, Strategy("full", 512, 4), batch);
  const Grads cpu_full = Gradients(*p.cpu, Strategy("full", 512, 4), batch);
  // f32's own error on these weights (stddev 0.3: attention far from uniform, gradients summing terms of both signs):
  // the CPU's f32 gradients against f64 over the same values. The GPU's f32 (full, or a strategy's other summation
  // order) may be as far from f64 in another direction, so it may differ by twice that, and by 1e-5 in any case.
  auto f64 = CreateTransformer(*TransformerPreset("tiny"), DType::kF64, Device::kCPU);
  ASSERT_TRUE(f64.ok()) << f64.status();
  for (size_t i = 0; i < p.cpu->params().size(); ++i) {
    std::vector<double> wide;
    for (float x : HostCopy<float>(p.cpu->params()[i].value)) wide.push_back(x);
    CopyFromHost((*f64)->params()[i].value, wide.data());
  }
  const double f32_error = ExpectClose(cpu_full, Gradients(**f64, Strategy("full", 512, 4), batch), 1e-3,
                                       "f32 tiny: cpu full vs cpu f64 full");
  const double tol = std::max(1e-5, 2 * f32_error);
  ExpectClose(gpu_full, cpu_full, tol, "f32 tiny: gpu full vs cpu full");
  for (const StrategyOptions& o : TransformerStrategies())
    ExpectClose(Gradients(*p.gpu, o, batch), gpu_full, tol, "f32 tiny: gpu " + Describe(o) + " vs gpu full");
}

// f64: the GPU's gradients equal the CPU's to near rounding, for full backprop and every strategy, on the presets
// (tiny-qwen2 adds biases and a tied head, tiny-qwen3.5 Gated DeltaNet layers and gated attention with partial
// RoPE, tiny-qwen3-moe and tiny-qwen3-next experts and a shared expert); also page-level sparse attention (seco
// --sparse_pages, page masks).
TEST_F(CudaStrategyTest, TransformerF64MatchesCpu) {
  for (const std::string preset : {"tiny", "tiny-qwen2", "tiny-qwen3.5", "tiny-qwen3-moe", "tiny-qwen3-next"}) {
    Pair p = Transformers(preset, DType::kF64);
    ASSERT_TRUE(p.gpu && p.cpu);
    const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 12345);
    std::vector<StrategyOptions> all = TransformerStrategies();
    all.insert(all.begin(), Strategy("full", 512, 4));
    StrategyOptions sparse = Strategy("seco", 4, 2);
    sparse.sparse_pages = 1;
    all.push_back(sparse);
    const Grads gpu_full = Gradients(*p.gpu, all[0], batch);
    for (const StrategyOptions& o : all) {
      const Grads gpu = Gradients(*p.gpu, o, batch), cpu = Gradients(*p.cpu, o, batch);
      ExpectClose(gpu, cpu, 1e-10, "f64 " + preset + ": gpu " + Describe(o) + " vs cpu");
      if (o.sparse_pages == 0)
        ExpectClose(gpu, gpu_full, 1e-10, "f64 " + preset + ": gpu " + Describe(o) + " vs gpu full");
    }
  }
}

// Mamba (tiny-ssm): seco and adjoint sharding (pairs and scan forms, a truncated window) on the GPU against the
// same strategy on the CPU, and the exact ones against full backprop on the GPU; f32 and f64.
TEST_F(CudaStrategyTest, MambaMatchesCpu) {
  for (DType dtype : {DType::kF32, DType::kF64}) {
    // f32: 2e-5, not 1e-5: dt_proj's gradient sums terms of both signs through the scan (on the CPU alone, seco vs
    // full already differ by 4e-6 there).
    const double tol = dtype == DType::kF64 ? 1e-10 : 2e-5;
    const std::string type = DTypeName(dtype);
    Pair p = Mambas(dtype);
    ASSERT_TRUE(p.gpu && p.cpu);
    const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 999);
    StrategyOptions scan_form = Strategy("adjoint", 5, 4);
    scan_form.adjoint_form = "scan";
    StrategyOptions truncated = Strategy("adjoint", 7, 4);
    truncated.adjoint_window = 3;  // not exact: compared with the CPU only
    const std::vector<StrategyOptions> all = {Strategy("full", 512, 4),   Strategy("seco", 2, 4),
                                              Strategy("seco", 7, 4),     Strategy("adjoint", 1, 4),
                                              Strategy("adjoint", 5, 4),  scan_form,
                                              Strategy("streambp", 5, 4), truncated};
    const Grads gpu_full = Gradients(*p.gpu, all[0], batch);
    for (const StrategyOptions& o : all) {
      const std::string what =
          type + " tiny-ssm: gpu " + Describe(o) + (o.name == "adjoint" ? " " + o.adjoint_form : "") +
          (o.adjoint_window != StrategyOptions::kNoAdjointWindow ? " window " + std::to_string(o.adjoint_window) : "");
      const Grads gpu = Gradients(*p.gpu, o, batch), cpu = Gradients(*p.cpu, o, batch);
      ExpectClose(gpu, cpu, tol, what + " vs cpu");
      if (o.adjoint_window == StrategyOptions::kNoAdjointWindow) ExpectClose(gpu, gpu_full, tol, what + " vs gpu full");
    }
  }
}

// Packed documents (core/documents_test.cc checks them on the CPU against the documents alone): a chunk runs the
// conv and scan ops on its pieces inside one document, at offsets into its rows; the GPU gives the CPU's gradients.
TEST_F(CudaStrategyTest, MambaDocumentsMatchCpu) {
  Pair p = Mambas(DType::kF64);
  ASSERT_TRUE(p.gpu && p.cpu);
  std::vector<Sequence> packed = {RaggedBatch(p.gpu->vocab_size(), 999)[0]};
  ASSERT_TRUE(SetDocuments(packed[0], {7, 3, 9, 1, 4}, "packed").ok());
  StrategyOptions scan_form = Strategy("adjoint", 4, 4);
  scan_form.adjoint_form = "scan";
  StrategyOptions truncated = Strategy("adjoint", 4, 4);
  truncated.adjoint_window = 3;
  for (const StrategyOptions& o : {Strategy("full", 512, 4), Strategy("seco", 4, 4), Strategy("adjoint", 5, 4),
                                   scan_form, truncated, Strategy("streambp", 3, 4)})
    ExpectClose(Gradients(*p.gpu, o, packed), Gradients(*p.cpu, o, packed), 1e-10,
                "f64 tiny-ssm documents: gpu " + Describe(o) + " " + o.adjoint_form + " vs cpu");
}

// A shape the CUDA kernels reject (head_dim 512 > the attention kernels' 256) is an error status naming the op,
// not an abort: either creating the model on the GPU refuses it, or the step fails with the kernel's exception
// turned into a status (CatchStrategyErrors); the process and the GPU stay usable.
TEST_F(CudaStrategyTest, KernelErrorIsAStatus) {
  if (SelfCheck()) GTEST_SKIP() << "a CUDA kernel limit";
  absl::StatusOr<TransformerConfig> config = TransformerPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  config->head_dim = 512;
  auto model = CreateTransformer(*config, DType::kF32, Device::kCUDA);
  if (!model.ok()) {
    EXPECT_NE(std::string(model.status().message()).find("head_dim"), std::string::npos) << model.status();
    std::cout << "refused when created: " << model.status() << "\n";
  } else {
    InitRandom(**model, Init(3));
    Trainer trainer(**model, Strategy("seco", 4, 3), {});
    absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(RaggedBatch((*model)->vocab_size(), 5));
    ASSERT_FALSE(m.ok()) << "head_dim 512 ran on the GPU";
    EXPECT_NE(std::string(m.status().message()).find("attention"), std::string::npos) << m.status();
    std::cout << "step failed: " << m.status() << "\n";
  }
  // Still usable: the tiny preset on the GPU gives the CPU's loss.
  Pair p = Transformers("tiny", DType::kF64);
  ASSERT_TRUE(p.gpu && p.cpu);
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 12345);
  ExpectClose(Gradients(*p.gpu, Strategy("seco", 4, 3), batch), Gradients(*p.cpu, Strategy("seco", 4, 3), batch), 1e-10,
              "f64 tiny after a failed step: gpu seco vs cpu");
}

// Mamba-2 layers (tiny-mamba2; tiny-bamba's beside attention and SwiGLU MLPs; tiny-falcon-h1's beside attention in
// every layer, with its multipliers and the LM head's), f64: every exact strategy and adjoint
// sharding (pairs and scan forms, a truncated window, packed documents) on the GPU against the same strategy on the
// CPU, and the exact ones against full backprop on the GPU.
TEST_F(CudaStrategyTest, Mamba2MatchesCpu) {
  for (const std::string preset : {"tiny-mamba2", "tiny-bamba", "tiny-falcon-h1"}) {
    Pair p = Transformers(preset, DType::kF64);
    ASSERT_TRUE(p.gpu && p.cpu);
    StrategyOptions scan_form = Strategy("adjoint", 4, 3);
    scan_form.adjoint_form = "scan";
    StrategyOptions truncated = Strategy("adjoint", 7, 4);
    truncated.adjoint_window = 3;  // not exact: compared with the CPU only
    const std::vector<StrategyOptions> all = {Strategy("full", 512, 4),
                                              Strategy("seco", 5, 2),
                                              Strategy("streambp", 4, 3),
                                              Strategy("adjoint", 5, 4),
                                              scan_form,
                                              truncated};
    for (bool packed : {false, true}) {
      std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 12345);
      if (packed) {
        ASSERT_TRUE(SetDocuments(batch[0], {7, 3, 9, 1, 4}, "packed").ok());
      }
      const Grads gpu_full = Gradients(*p.gpu, all[0], batch);
      for (const StrategyOptions& o : all) {
        const std::string what =
            "f64 " + preset + (packed ? " documents" : "") + ": gpu " + Describe(o) +
            (o.name == "adjoint" ? " " + o.adjoint_form : "") +
            (o.adjoint_window != StrategyOptions::kNoAdjointWindow ? " window " + std::to_string(o.adjoint_window)
                                                                   : "");
        const Grads gpu = Gradients(*p.gpu, o, batch);
        ExpectClose(gpu, Gradients(*p.cpu, o, batch), 1e-10, what + " vs cpu");
        if (o.adjoint_window == StrategyOptions::kNoAdjointWindow)
          ExpectClose(gpu, gpu_full, 1e-10, what + " vs gpu full");
      }
    }
  }
}

// Without a GPU, a model cannot be created on it: FailedPrecondition naming the device and why (the probe's reason),
// for both families. Skipped where a GPU is present.
TEST(CudaDeviceTest, CreateWithoutGpuIsFailedPrecondition) {
  SG_REQUIRE_BACKEND();
  const std::string why = DeviceUnavailableReason(Device::kCUDA);
  if (why.empty()) GTEST_SKIP() << "a usable CUDA device is present: this test checks the refusal without one";
  const absl::Status check = CheckDevice(Device::kCUDA);
  EXPECT_EQ(check.code(), absl::StatusCode::kFailedPrecondition) << check;
  auto transformer = CreateTransformer(*TransformerPreset("tiny"), DType::kF32, Device::kCUDA);
  ASSERT_FALSE(transformer.ok());
  auto mamba = CreateMamba(*MambaPreset("tiny-ssm"), DType::kF64, Device::kCUDA);
  ASSERT_FALSE(mamba.ok());
  for (const absl::Status& s : {check, transformer.status(), mamba.status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    const std::string message(s.message());
    EXPECT_NE(message.find("'cuda'"), std::string::npos) << message;  // "device 'cuda' cannot run: <why>"
    EXPECT_NE(message.find(why), std::string::npos) << message;       // the probe's reason, not "built without"
  }
}

// Expert offload on the GPU: the experts' host homes are pinned memory and their slots are filled on a copy stream;
// LoRA (attention and experts) gradients on tiny-qwen3-next are the bits of the same GPU run without it (f64), under
// full, ckpt, streambp and seco with and without KV offload.
TEST_F(CudaStrategyTest, ExpertOffloadIsBitIdentical) {
  LoraOptions lora;
  lora.rank = 2;
  lora.targets = {"q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"};
  lora.seed = 5;
  Pair resident = Transformers("tiny-qwen3-next", DType::kF64),
       offloaded = Transformers("tiny-qwen3-next", DType::kF64);
  ASSERT_TRUE(resident.gpu && offloaded.gpu);
  for (Model* m : {resident.gpu.get(), offloaded.gpu.get()}) {
    ASSERT_TRUE(EnableLora(*m, lora).ok());
    RandomizeLoraB(*m, 9, 0.2);
  }
  const std::vector<Sequence> batch = RaggedBatch(resident.gpu->vocab_size(), 4321);
  StrategyOptions kv_offload = Strategy("seco", 4, 2);
  kv_offload.offload = true;
  for (StrategyOptions o : {Strategy("full", 512, 4), Strategy("ckpt", 512, 4), Strategy("streambp", 7, 4),
                            Strategy("seco", 4, 2), kv_offload}) {
    const Grads plain = Gradients(*resident.gpu, o, batch);
    o.offload_experts = true;
    const Grads streamed = Gradients(*offloaded.gpu, o, batch);
    EXPECT_EQ(streamed.loss, plain.loss) << Describe(o);
    EXPECT_EQ(streamed.g, plain.g) << Describe(o);
  }
  EXPECT_GT(offloaded.gpu->OffloadedWeightBytes(), 0);
  // Merging reads the experts from their host homes and the adapters from the device.
  for (const LoraAdapter& ad : offloaded.gpu->lora()->adapters) {
    const size_t bytes = offloaded.gpu->params()[ad.weight].value.nbytes();
    std::vector<char> merged(bytes), expected(bytes);
    MergedWeight(*offloaded.gpu, ad, merged.data());
    MergedWeight(*resident.gpu, ad, expected.data());
    EXPECT_EQ(merged, expected) << offloaded.gpu->params()[ad.weight].name;
  }
}

// Host code reaches the device's tensors only through copies: LoRA's initialisation and dropout masks, KV offload,
// an optimizer step (gradient norm, clipping), saving and loading a model give the CPU's numbers (f64). Under the
// emulation a missed host access faults instead.
TEST_F(CudaStrategyTest, HostAccessPathsMatchCpu) {
  Pair p = Transformers("tiny", DType::kF64);
  ASSERT_TRUE(p.gpu && p.cpu);
  LoraOptions lora;
  lora.rank = 4;
  lora.dropout = 0.25;
  lora.targets = {"q_proj", "v_proj", "down_proj"};
  lora.seed = 5;
  for (Model* m : {p.cpu.get(), p.gpu.get()}) {
    ASSERT_TRUE(EnableLora(*m, lora).ok());
    RandomizeLoraB(*m, 9, 0.2);
  }
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 4321);
  StrategyOptions offload = Strategy("seco", 4, 2);
  offload.offload = true;
  for (const StrategyOptions& o : {Strategy("seco", 4, 3), offload})
    ExpectClose(Gradients(*p.gpu, o, batch), Gradients(*p.cpu, o, batch), 1e-10,
                "f64 tiny LoRA dropout: gpu " + Describe(o) + (o.offload ? " offload" : "") + " vs cpu");

  OptimizerOptions opt;
  opt.clip_grad_norm = 1e-3;  // clips: the norm and the scaling run on the device
  Trainer cpu_trainer(*p.cpu, Strategy("seco", 5, 3), opt), gpu_trainer(*p.gpu, Strategy("seco", 5, 3), opt);
  ASSERT_TRUE(cpu_trainer.Step(batch).ok());
  ASSERT_TRUE(gpu_trainer.Step(batch).ok());

  // A checkpoint of the device's weights and moments, and back after another step changed them.
  const std::string out_dir = std::string(std::getenv("TEST_TMPDIR")) + "/gpu_checkpoints";
  CheckpointMeta meta;
  meta.trainer = gpu_trainer.state();
  absl::StatusOr<std::string> saved = SaveCheckpoint(out_dir, gpu_trainer, meta, 0);
  ASSERT_TRUE(saved.ok()) << saved.status();
  auto values = [&] {
    std::vector<std::vector<double>> v;
    for (const Param& q : p.gpu->params()) v.push_back(HostCopy<double>(q.value));
    for (const Tensor& m : gpu_trainer.optimizer().m())
      v.push_back(m.defined() ? HostCopy<double>(m) : std::vector<double>());
    return v;
  };
  const std::vector<std::vector<double>> at_checkpoint = values();
  ASSERT_TRUE(gpu_trainer.Step(batch).ok());
  ASSERT_NE(values(), at_checkpoint);
  absl::StatusOr<CheckpointMeta> loaded_meta = LoadCheckpoint(*saved, gpu_trainer);
  ASSERT_TRUE(loaded_meta.ok()) << loaded_meta.status();
  EXPECT_EQ(values(), at_checkpoint) << "weights and moments after loading the checkpoint on the device";
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/gpu_model";
  ASSERT_TRUE(SaveModel(*p.gpu, dir).ok());
  auto loaded = LoadModel(dir, DType::kF64, 0, Gpu());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (size_t i = 0; i < p.cpu->params().size(); ++i) {
    const Param& c = p.cpu->params()[i];
    if (c.name.find("lora_") != std::string::npos) continue;  // saved merged into the base weights
    const std::vector<double> cpu = HostCopy<double>(c.value), gpu = HostCopy<double>(p.gpu->params()[i].value);
    double worst = 0;
    for (size_t k = 0; k < cpu.size(); ++k) worst = std::max(worst, std::abs(cpu[k] - gpu[k]));
    EXPECT_LE(worst, 1e-12) << c.name << " after an optimizer step";
  }
  // The loaded model has the base parameters, in order; adapted weights were saved merged.
  ASSERT_LT((*loaded)->params().size(), p.gpu->params().size());
  for (size_t i = 0; i < (*loaded)->params().size(); ++i) {
    const Param& q = (*loaded)->params()[i];
    ASSERT_EQ(q.name, p.gpu->params()[i].name);
    if (p.gpu->lora()->AdapterOfWeight(static_cast<int>(i))) continue;
    EXPECT_EQ(HostCopy<double>(q.value), HostCopy<double>(p.gpu->params()[i].value)) << q.name << " saved and loaded";
  }
}

// SEQGRAD_CUDA_SYNC=1 (wait after every op) changes nothing but when faults show: the same bits.
TEST_F(CudaStrategyTest, SyncEveryOpGivesTheSameBits) {
  Pair p = Transformers("tiny", DType::kF32);
  ASSERT_TRUE(p.gpu && p.cpu);
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 777);
  StrategyOptions sparse = Strategy("seco", 4, 2);
  sparse.sparse_pages = 1;
  for (const StrategyOptions& o : {Strategy("seco", 5, 3), sparse}) {
    unsetenv("SEQGRAD_CUDA_SYNC");
    const Grads async = Gradients(*p.gpu, o, batch);
    setenv("SEQGRAD_CUDA_SYNC", "1", 1);
    const Grads sync = Gradients(*p.gpu, o, batch);
    unsetenv("SEQGRAD_CUDA_SYNC");
    ASSERT_FALSE(async.g.empty());
    EXPECT_EQ(async.loss, sync.loss) << Describe(o);
    EXPECT_EQ(async.g, sync.g) << Describe(o) << ": gradients differ with SEQGRAD_CUDA_SYNC=1";
  }
}

// The ops that replaced host loops inside a chunk (kernels/ops.inc's in-chunk block) give the CPU table's bits on the
// device: LoRA dropout (its mask is kernels/dropout_mask.h's hash), A = -exp(A_log) and its gradient, column sums in
// f64 and sparse attention's page scores.
template <typename T>
void ExpectChunkOpsMatchCpu() {
  const std::string type = std::is_same_v<T, double> ? "f64" : "f32";
  const DType dtype = std::is_same_v<T, double> ? DType::kF64 : DType::kF32;
  const OpTable<T>& gpu = OpsFor<T>(Gpu());
  const OpTable<T>& cpu = CpuOps<T>();
  MemoryTracker mem;
  mem.set_device(Gpu());
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal;
  auto random = [&](int64_t count) {
    std::vector<T> v(count);
    for (T& x : v) x = static_cast<T>(normal(rng));
    return v;
  };
  auto on_device = [&](const auto& host, DType t) {
    Tensor d = Tensor::Empty(&mem, MemCategory::kWorkspace, t, {static_cast<int64_t>(host.size())});
    CopyFromHost(d, host.data());
    return d;
  };

  // LoRA dropout over 37 positions from 5 and 53 features from 11 (module 4, seed 99, p 0.3).
  const int64_t n = 37, cols = 53;
  const std::vector<T> x = random(n * cols), y0 = random(n * cols);
  for (bool accumulate : {false, true}) {
    std::vector<T> want = y0;
    cpu.lora_dropout(x.data(), n, cols, 99, 4, 5, 11, 0.3, accumulate, want.data());
    Tensor dx = on_device(x, dtype), dy = on_device(y0, dtype);
    gpu.lora_dropout(dx.template data<T>(), n, cols, 99, 4, 5, 11, 0.3, accumulate, dy.template data<T>());
    EXPECT_EQ(HostCopy<T>(dy), want) << type << " lora_dropout, accumulate " << accumulate;
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const bool keep = LoraKeep(LoraRowKey(99, 4, 5 + i), 11 + j, 0.3);
        kept += keep;
        const T expected =
            accumulate ? (keep ? y0[i * cols + j] + x[i * cols + j] * static_cast<T>(1 / 0.7) : y0[i * cols + j])
                       : (keep ? x[i * cols + j] * static_cast<T>(1 / 0.7) : T(0));
        ASSERT_EQ(want[i * cols + j], expected) << type << " the mask of kernels/dropout_mask.h at " << i << ", " << j;
      }
    EXPECT_NEAR(static_cast<double>(kept) / (n * cols), 0.7, 0.05);
  }

  // Mamba's A = -exp(A_log), dA_log += dA * A.
  const std::vector<T> a_log = random(50), da = random(50), g0 = random(50);
  std::vector<T> a(50), g = g0;
  cpu.ssm_neg_exp(a_log.data(), 50, a.data());
  cpu.ssm_neg_exp_backward(da.data(), a.data(), 50, g.data());
  Tensor d_a_log = on_device(a_log, dtype), d_a = on_device(a_log, dtype), d_da = on_device(da, dtype),
         d_g = on_device(g0, dtype);
  gpu.ssm_neg_exp(d_a_log.template data<T>(), 50, d_a.template data<T>());
  // A GPU's exp is not the C library's (CUDA's is within 2 ulp, not correctly rounded): within 2 ulp here.
  const std::vector<T> got_a = HostCopy<T>(d_a);
  for (int i = 0; i < 50; ++i)
    EXPECT_LE(std::abs(got_a[i] - a[i]), 2 * (std::nextafter(std::abs(a[i]), T(INFINITY)) - std::abs(a[i])))
        << type << " ssm_neg_exp at " << i << ": " << got_a[i] << " vs " << a[i];
  // The backward's products and sums are the CPU's, bit for bit, from the CPU's A.
  Tensor d_cpu_a = on_device(a, dtype);
  gpu.ssm_neg_exp_backward(d_da.template data<T>(), d_cpu_a.template data<T>(), 50, d_g.template data<T>());
  EXPECT_EQ(HostCopy<T>(d_g), g) << type << " ssm_neg_exp_backward";

  // Column sums (13 rows of 29), then page scores of 5 pages from page 1 (4 query heads, 2 KV heads of 8 dims).
  const std::vector<T> rows = random(13 * 29);
  std::vector<double> sums(29);
  cpu.column_sums_f64(rows.data(), 13, 29, sums.data());
  Tensor d_rows = on_device(rows, dtype), d_sums = on_device(sums, DType::kF64);
  gpu.column_sums_f64(d_rows.template data<T>(), 13, 29, d_sums.template data<double>());
  EXPECT_EQ(HostCopy<double>(d_sums), sums) << type << " column_sums_f64";
  std::vector<double> q_sums(4 * 8), key_sums(7 * 2 * 8), scores(5);
  for (double& v : q_sums) v = normal(rng);
  for (double& v : key_sums) v = normal(rng);
  cpu.page_scores(q_sums.data(), 6, 4, 2, 8, key_sums.data(), 1, 5, 3, scores.data());
  Tensor d_q = on_device(q_sums, DType::kF64), d_k = on_device(key_sums, DType::kF64),
         d_scores = on_device(scores, DType::kF64);
  gpu.page_scores(d_q.template data<double>(), 6, 4, 2, 8, d_k.template data<double>(), 1, 5, 3,
                  d_scores.template data<double>());
  EXPECT_EQ(HostCopy<double>(d_scores), scores) << type << " page_scores";
}

TEST_F(CudaStrategyTest, ChunkOpsMatchCpuBits) {
  ExpectChunkOpsMatchCpu<float>();
  ExpectChunkOpsMatchCpu<double>();
}

// Host copies of the device's memory (DeviceHostCopies) made inside chunks: from a chunk's start (the backend's
// begin_chunk) to the next chunk's start or the step's end (its synchronize), per chunk.
class InChunkCopies {
 public:
  struct Window {
    std::string label;
    HostCopyCounts copies;
  };
  explicit InChunkCopies(Device d) : device_(d), saved_(*FindBackend(d)) {
    active_ = this;
    DeviceBackend b = saved_;
    b.begin_chunk = [](const std::string& label) {
      active_->Close();
      if (active_->saved_.begin_chunk) active_->saved_.begin_chunk(label);
      active_->open_ = true;
      active_->label_ = label;
      active_->start_ = DeviceHostCopies();
    };
    b.synchronize = [] {
      active_->Close();
      if (active_->saved_.synchronize) active_->saved_.synchronize();
    };
    RegisterBackend(d, b);
  }
  ~InChunkCopies() {
    RegisterBackend(device_, saved_);
    active_ = nullptr;
  }
  const std::vector<Window>& windows() const { return windows_; }

 private:
  void Close() {
    if (!open_) return;
    open_ = false;
    const HostCopyCounts now = DeviceHostCopies();
    windows_.push_back({label_, {now.to_host - start_.to_host, now.from_host - start_.from_host}});
  }
  static inline InChunkCopies* active_ = nullptr;
  Device device_;
  DeviceBackend saved_;
  bool open_ = false;
  std::string label_;
  HostCopyCounts start_;
  std::vector<Window> windows_;
};

// Runs o on the GPU model and returns its gradients, expecting no host copy inside any chunk but `score_copies`
// (sparse attention's page scores, one per layer of each chunk that selects pages) in all.
Grads GradientsWithoutHostCopies(Model& gpu, const StrategyOptions& o, const std::vector<Sequence>& batch,
                                 int64_t score_copies, const std::string& what) {
  InChunkCopies copies(Gpu());
  Grads g = Gradients(gpu, o, batch);
  int64_t to_host = 0;
  for (const InChunkCopies::Window& w : copies.windows()) {
    to_host += w.copies.to_host;
    EXPECT_EQ(w.copies.from_host, 0) << what << ", " << w.label << ": copies from the host";
    EXPECT_LE(w.copies.to_host, o.sparse_pages > 0 ? gpu.num_layers() : 0) << what << ", " << w.label;
  }
  EXPECT_FALSE(copies.windows().empty()) << what << ": no chunk started";
  EXPECT_EQ(to_host, SelfCheck() ? 0 : score_copies) << what << ": copies to the host inside chunks";
  std::cout << what << ": " << copies.windows().size() << " chunk passes, " << to_host
            << " copies to the host inside them (page scores)\n";
  return g;
}

// LoRA with dropout on every module the family allows, on both models of p (B random: every gradient nonzero).
void EnableLoraDropout(Pair& p, const std::string& family) {
  LoraOptions lora;
  lora.rank = 4;
  lora.dropout = 0.25;
  lora.seed = 5;
  lora.targets = LoraTargetModules(family);
  for (Model* m : {p.cpu.get(), p.gpu.get()}) {
    ASSERT_TRUE(EnableLora(*m, lora).ok());
    RandomizeLoraB(*m, 9, 0.2);
  }
}

// No chunk waits for the device through a host copy (issue 19): LoRA dropout masks, Mamba's A and its gradient
// and sparse attention's key sums run on the device; a chunk that selects pages reads back only their scores. The
// token cross-entropy (SFT) stays on the device until the step's end (core/loss_sum.h): the trainer's read of it
// goes through CopyToHost, so reading it before the step's last chunk is done would count here. The gradients and
// the loss still match the CPU's.
TEST_F(CudaStrategyTest, ChunksMakeNoHostCopies) {
  {
    Pair p = Transformers("tiny", DType::kF64);
    ASSERT_TRUE(p.gpu && p.cpu);
    EnableLoraDropout(p, "transformer");
    const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 4321);
    StrategyOptions sparse = Strategy("seco", 4, 2);
    sparse.sparse_pages = 1;
    int64_t selecting = 0;  // chunks whose first pass picks pages: more than sparse_pages candidates before them
    for (const Sequence& s : batch)
      for (int64_t b = 0; b < static_cast<int64_t>(s.ids.size()); b += sparse.chunk)
        selecting += b / sparse.page_size - 2 > sparse.sparse_pages;
    ASSERT_GT(selecting, 0);
    for (const StrategyOptions& o : {sparse, Strategy("seco", 4, 2), Strategy("streambp", 4, 3),
                                     Strategy("ckpt", 512, 4), Strategy("full", 512, 4)}) {
      const std::string what = "f64 tiny LoRA dropout " + Describe(o);
      const int64_t scores = o.sparse_pages > 0 ? selecting * p.gpu->num_layers() : 0;
      ExpectClose(GradientsWithoutHostCopies(*p.gpu, o, batch, scores, what), Gradients(*p.cpu, o, batch), 1e-10,
                  what + ": gpu vs cpu");
    }
  }
  Pair p = Mambas(DType::kF64);
  ASSERT_TRUE(p.gpu && p.cpu);
  EnableLoraDropout(p, "ssm");
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 999);
  for (const StrategyOptions& o : {Strategy("seco", 7, 4), Strategy("adjoint", 5, 4), Strategy("streambp", 5, 4)}) {
    const std::string what = "f64 tiny-ssm LoRA dropout " + Describe(o);
    ExpectClose(GradientsWithoutHostCopies(*p.gpu, o, batch, 0, what), Gradients(*p.cpu, o, batch), 1e-10,
                what + ": gpu vs cpu");
  }
}

#ifdef SG_CUDA_EMULATED
// A kernel fault (injected by the emulator) surfaces at the next check as a status naming the op and its chunk; with
// SEQGRAD_CUDA_SYNC=1 at the op itself. The emulated device then stays usable (on a GPU a fault is sticky).
TEST_F(CudaStrategyTest, KernelFaultNamesTheOpAndChunk) {
  Pair p = Transformers("tiny", DType::kF32);
  ASSERT_TRUE(p.gpu && p.cpu);
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 4);
  for (const bool sync : {false, true}) {
    if (sync) setenv("SEQGRAD_CUDA_SYNC", "1", 1);
    sg_emu::InjectKernelError("SwigluBackwardKernel", /*skip=*/4);  // in the backward of an earlier chunk
    Trainer trainer(*p.gpu, Strategy("seco", 4, 3), {});
    absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(batch);
    unsetenv("SEQGRAD_CUDA_SYNC");
    ASSERT_FALSE(m.ok()) << "an injected kernel fault went unreported (sync " << sync << ")";
    const std::string message(m.status().message());
    std::cout << (sync ? "SEQGRAD_CUDA_SYNC=1: " : "default: ") << m.status() << "\n";
    // The op with its chunk: exactly (sync), or among the ops in flight of that chunk, listed as
    // "chunk [b, e): op, op x3, ...".
    const std::regex named(sync ? R"(swiglu_backward \(chunk \[\d+, \d+\)\): kernel \(SEQGRAD_CUDA_SYNC=1: this op\))"
                                : R"(ops in flight since the last check.*chunk \[\d+, \d+\):[^;]* swiglu_backward)");
    EXPECT_TRUE(std::regex_search(message, named)) << message;
    EXPECT_NE(message.find("injected kernel error"), std::string::npos) << message;
  }
  ExpectClose(Gradients(*p.gpu, Strategy("seco", 4, 3), batch), Gradients(*p.cpu, Strategy("seco", 4, 3), batch), 1e-5,
              "f32 tiny after kernel faults: gpu seco vs cpu");
}

// Out of device memory mid-step (the emulated device has SG_EMU_DEVICE_MEMORY bytes, see BUILD): RESOURCE_EXHAUSTED
// naming the device's memory, and the model stays usable.
TEST_F(CudaStrategyTest, OutOfDeviceMemoryIsResourceExhausted) {
  Pair p = Transformers("tiny", DType::kF32);
  ASSERT_TRUE(p.gpu && p.cpu);
  int64_t free_bytes = 0, total = 0;
  FindBackend(Device::kCUDA)->memory_info(&free_bytes, &total);
  Sequence s;  // KV + KV-gradient pools alone take 2 x 2 x layers x kv_heads x head_dim x 4 bytes per token
  const int64_t per_token = 4 * p.gpu->num_layers() * 2 * 8 * 4;
  for (int64_t i = 0; i < total / per_token + 1000; ++i) s.ids.push_back(static_cast<int32_t>(i % 90));
  s.labels = s.ids;
  Trainer trainer(*p.gpu, Strategy("seco", 4096, 256), {});
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients({s});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted) << m.status();
  EXPECT_NE(std::string(m.status().message()).find("out of device memory"), std::string::npos) << m.status();
  std::cout << m.status() << "\n";
  const std::vector<Sequence> batch = RaggedBatch(p.gpu->vocab_size(), 12345);
  ExpectClose(Gradients(*p.gpu, Strategy("seco", 4, 3), batch), Gradients(*p.cpu, Strategy("seco", 4, 3), batch), 1e-5,
              "f32 tiny after running out of device memory: gpu seco vs cpu");
}
#endif

}  // namespace
}  // namespace sg
