// Dumps the loss and every parameter gradient of one batch, computed by a strategy in f64, for comparison
// against a PyTorch autograd reference (tests/torch_ref/torch_ref_test.py).
//
//   grad_dump --model_dir=DIR --batch_jsonl=FILE --strategy=full --page_size=16 --lm_chunk=7 --out=grads.safetensors
//   grad_dump --model_dir=DIR --objective=grpo --data=groups.jsonl --grpo_kl_beta=0.1 --out=grads.safetensors
//
// --objective=sft (default) reads --batch_jsonl (LoadJsonl); dpo and grpo read --data with LoadDpoJsonl /
// LoadGrpoJsonl. The gradients come from Trainer::ComputeGradients(Batch).
//
// The output holds one f64 tensor per parameter, named like the parameter (Hugging Face names), and the
// objective's loss of the batch in the metadata ("loss", printed with %.17g so it round-trips exactly; sft: mean
// token loss), with "tokens", "chunks" and "chunks_backpropagated" from the step's metrics.
//
// LoRA (tests/torch_ref/lora_peft_test.py): --lora_init=DIR loads a PEFT adapter (the base is then frozen and only
// the adapters' gradients are written), --lora_save=DIR writes it back as the engine saves adapters, and
// --merged_out=DIR writes the merged model (SaveModel).
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/data.h"
#include "core/io/safetensors.h"
#include "core/lora_io.h"
#include "core/model_io.h"
#include "core/objective.h"
#include "core/trainer.h"
#include "kernels/backend.h"

ABSL_FLAG(std::string, model_dir, "", "Hugging Face model directory (config.json + model.safetensors)");
ABSL_FLAG(std::string, batch_jsonl, "",
          "JSONL batch: {\"input_ids\": [...], \"labels\": [...]} per line (HF convention)");
ABSL_FLAG(std::string, strategy, "full", "gradient strategy (any name sg::FindStrategy knows)");
ABSL_FLAG(int64_t, chunk, 512, "tokens per chunk (chunked strategies)");
ABSL_FLAG(int64_t, page_size, 256, "KV-cache page size in tokens");
ABSL_FLAG(int64_t, lm_chunk, 256, "LM-head rows computed at a time");
ABSL_FLAG(int64_t, spaco_budget, 8, "spaco: chunks backpropagated per sequence on average");
ABSL_FLAG(double, spaco_cap, 2.0, "spaco: cap on relayed-state compensation (0 = none)");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed (spaco)");
ABSL_FLAG(std::string, adjoint_form, "pairs", "adjoint: pairs | scan | paper (StrategyOptions::adjoint_form)");
ABSL_FLAG(int64_t, adjoint_window, 0, "adjoint (pairs, paper): keep the pairs with t - i < this; 0 = no window");
ABSL_FLAG(std::string, objective, "sft", "training objective: sft | dpo | grpo");
ABSL_FLAG(std::string, data, "", "dpo / grpo: JSONL of preference pairs / groups (core/data.h formats)");
ABSL_FLAG(double, dpo_beta, 0.1, "dpo: beta");
ABSL_FLAG(double, grpo_clip_eps, 0.2, "grpo: clip epsilon of the ratio");
ABSL_FLAG(double, grpo_kl_beta, 0.04, "grpo: weight of the k3 KL term");
ABSL_FLAG(bool, grpo_kl_bias_correction, true, "grpo: the KL term times the importance ratio (TRL's default)");
ABSL_FLAG(std::string, dtype, "f64", "f64, or bf16 (bf16 weights, f32 compute; gradients written as f64)");
ABSL_FLAG(std::string, matmul, "fp32",
          "how f32 products multiply: fp32, or bf16 (with --dtype=bf16: f32 operands rounded to bf16, fp32 sums)");
ABSL_FLAG(std::string, out, "", "output safetensors file (f64 gradients, loss in the metadata)");
ABSL_FLAG(std::string, lora_init, "", "PEFT adapter directory to load (LoRA: only adapter gradients are written)");
ABSL_FLAG(std::string, lora_save, "", "with --lora_init: write the adapter back (SaveLoraAdapter) to this directory");
ABSL_FLAG(std::string, merged_out, "", "with --lora_init: write the merged model (SaveModel) to this directory");

namespace sg {
namespace {

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  const std::string out = absl::GetFlag(FLAGS_out);
  ObjectiveOptions objective;
  objective.name = absl::GetFlag(FLAGS_objective);
  objective.dpo_beta = absl::GetFlag(FLAGS_dpo_beta);
  objective.grpo_clip_eps = absl::GetFlag(FLAGS_grpo_clip_eps);
  objective.grpo_kl_beta = absl::GetFlag(FLAGS_grpo_kl_beta);
  objective.grpo_kl_bias_correction = absl::GetFlag(FLAGS_grpo_kl_bias_correction);
  if (absl::Status s = ValidateObjectiveOptions(objective); !s.ok()) return s;
  const bool sft = objective.name == "sft";
  const std::string input = sft ? absl::GetFlag(FLAGS_batch_jsonl) : absl::GetFlag(FLAGS_data);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  if (input.empty())
    return absl::InvalidArgumentError(sft ? std::string("--batch_jsonl is required")
                                          : absl::StrCat("--data is required for --objective=", objective.name));
  if (out.empty()) return absl::InvalidArgumentError("--out is required");

  StrategyOptions opts;
  opts.name = absl::GetFlag(FLAGS_strategy);
  opts.chunk = absl::GetFlag(FLAGS_chunk);
  opts.page_size = absl::GetFlag(FLAGS_page_size);
  opts.lm_chunk = absl::GetFlag(FLAGS_lm_chunk);
  opts.spaco_budget = absl::GetFlag(FLAGS_spaco_budget);
  opts.spaco_cap = absl::GetFlag(FLAGS_spaco_cap);
  opts.seed = absl::GetFlag(FLAGS_seed);
  opts.adjoint_form = absl::GetFlag(FLAGS_adjoint_form);
  if (const int64_t window = absl::GetFlag(FLAGS_adjoint_window); window != 0) opts.adjoint_window = window;
  if (absl::Status s = ValidateStrategyOptions(opts); !s.ok()) return s;

  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name != "f64" && dtype_name != "bf16")
    return absl::InvalidArgumentError(absl::StrCat("--dtype: '", dtype_name, "' is not supported (f64, bf16)"));
  const DType dtype = dtype_name == "bf16" ? DType::kBF16 : DType::kF64;
  const std::string matmul = absl::GetFlag(FLAGS_matmul);
  if (matmul != "fp32" && dtype != DType::kBF16)
    return absl::InvalidArgumentError(
        absl::StrCat("--matmul=", matmul, " needs --dtype=bf16 (f64 products never round)"));
  if (const std::string refused = FindBackend(Device::kCPU)->set_matmul(matmul); !refused.empty())
    return absl::InvalidArgumentError(absl::StrCat("--matmul: ", refused));
  absl::StatusOr<std::unique_ptr<Model>> model = LoadAnyModel(model_dir, dtype, 0);
  if (!model.ok()) return model.status();
  const int64_t vocab = (*model)->vocab_size();
  const std::string lora_init = absl::GetFlag(FLAGS_lora_init);
  if (!lora_init.empty()) {
    if (absl::Status s = LoadLoraAdapter(**model, lora_init); !s.ok()) return s;
    if (const std::string dir = absl::GetFlag(FLAGS_lora_save); !dir.empty())
      if (absl::Status s = SaveLoraAdapter(**model, dir, model_dir); !s.ok()) return s;
    if (const std::string dir = absl::GetFlag(FLAGS_merged_out); !dir.empty())
      if (absl::Status s = SaveModel(**model, dir, model_dir); !s.ok()) return s;
  }
  Batch batch;
  if (objective.name == "dpo") {
    absl::StatusOr<std::vector<DpoPair>> pairs = LoadDpoJsonl(input, vocab);
    if (!pairs.ok()) return pairs.status();
    batch.pairs = std::move(*pairs);
  } else if (objective.name == "grpo") {
    absl::StatusOr<std::vector<GrpoGroup>> groups = LoadGrpoJsonl(input, vocab);
    if (!groups.ok()) return groups.status();
    batch.groups = std::move(*groups);
  } else {
    absl::StatusOr<std::vector<Sequence>> seqs = LoadJsonl(input, int64_t{1} << 30, vocab);
    if (!seqs.ok()) return seqs.status();
    batch.sequences = std::move(*seqs);
  }

  Trainer trainer(**model, opts, {}, objective);
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(batch);
  if (!m.ok()) return m.status();

  std::vector<io::TensorToWrite> tensors;
  std::vector<std::vector<double>> widened;  // f32 gradients (--dtype=bf16) as f64
  widened.reserve((*model)->params().size());
  for (Param& p : (*model)->params()) {
    if (!p.grad.defined() && (*model)->lora()) continue;  // frozen base
    if (!p.grad.defined()) return absl::InternalError(absl::StrCat("parameter '", p.name, "' has no gradient"));
    const void* data = p.grad.raw();
    if (p.grad.dtype() == DType::kF32) {
      widened.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
      data = widened.back().data();
    } else if (p.grad.dtype() != DType::kF64) {
      return absl::InternalError(absl::StrCat("gradient of '", p.name, "' is ", DTypeName(p.grad.dtype())));
    }
    tensors.push_back({p.name, DType::kF64, p.grad.shape(), data});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"loss", absl::StrFormat("%.17g", m->loss)},
      {"tokens", absl::StrCat(m->tokens)},
      {"chunks", absl::StrCat(m->chunks)},
      {"chunks_backpropagated", absl::StrCat(m->chunks_backpropagated)},
      {"strategy", opts.name},
      {"objective", objective.name},
      {"dtype", dtype_name},
      {"matmul", absl::GetFlag(FLAGS_matmul)},
  };
  return io::WriteSafetensors(out, tensors, metadata);
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes the f64 loss and parameter gradients of a batch (for the torch reference test).");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = sg::Run(); !s.ok()) {
    std::fprintf(stderr, "grad_dump: error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
