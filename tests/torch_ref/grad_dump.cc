// Dumps the loss and every parameter gradient of one batch, computed by a strategy in f64, for comparison
// against a PyTorch autograd reference (tests/torch_ref/torch_ref_test.py).
//
//   grad_dump --model_dir=DIR --batch_jsonl=FILE --strategy=full --page_size=16 --lm_chunk=7 --out=grads.safetensors
//
// The output holds one f64 tensor per parameter, named like the parameter (Hugging Face names), and the mean
// token loss of the batch in the metadata ("loss", printed with %.17g so it round-trips exactly).
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/data.h"
#include "core/io/safetensors.h"
#include "core/model_io.h"
#include "core/trainer.h"

ABSL_FLAG(std::string, model_dir, "", "Hugging Face model directory (config.json + model.safetensors)");
ABSL_FLAG(std::string, batch_jsonl, "", "JSONL batch: {\"input_ids\": [...], \"labels\": [...]} per line (HF convention)");
ABSL_FLAG(std::string, strategy, "full", "gradient strategy (any name sg::FindStrategy knows)");
ABSL_FLAG(int64_t, chunk, 512, "tokens per chunk (chunked strategies)");
ABSL_FLAG(int64_t, page_size, 256, "KV-cache page size in tokens");
ABSL_FLAG(int64_t, lm_chunk, 256, "LM-head rows computed at a time");
ABSL_FLAG(std::string, out, "", "output safetensors file (f64 gradients, loss in the metadata)");

namespace sg {
namespace {

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  const std::string batch_path = absl::GetFlag(FLAGS_batch_jsonl);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (model_dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  if (batch_path.empty()) return absl::InvalidArgumentError("--batch_jsonl is required");
  if (out.empty()) return absl::InvalidArgumentError("--out is required");

  absl::StatusOr<std::unique_ptr<TransformerModel>> model = LoadModel(model_dir, DType::kF64, 0);
  if (!model.ok()) return model.status();
  absl::StatusOr<std::vector<Sequence>> batch = LoadJsonl(batch_path, int64_t{1} << 30, (*model)->vocab_size());
  if (!batch.ok()) return batch.status();

  StrategyOptions opts;
  opts.name = absl::GetFlag(FLAGS_strategy);
  opts.chunk = absl::GetFlag(FLAGS_chunk);
  opts.page_size = absl::GetFlag(FLAGS_page_size);
  opts.lm_chunk = absl::GetFlag(FLAGS_lm_chunk);
  if (absl::Status s = ValidateStrategyOptions(opts); !s.ok()) return s;

  Trainer trainer(**model, opts, {});
  absl::StatusOr<StepMetrics> m = trainer.ComputeGradients(*batch);
  if (!m.ok()) return m.status();

  std::vector<io::TensorToWrite> tensors;
  for (Param& p : (*model)->params()) {
    if (!p.grad.defined()) return absl::InternalError(absl::StrCat("parameter '", p.name, "' has no gradient"));
    if (p.grad.dtype() != DType::kF64)
      return absl::InternalError(absl::StrCat("gradient of '", p.name, "' is ", DTypeName(p.grad.dtype())));
    tensors.push_back({p.name, DType::kF64, p.grad.shape(), p.grad.raw()});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"loss", absl::StrFormat("%.17g", m->loss)},
      {"tokens", absl::StrCat(m->tokens)},
      {"strategy", opts.name},
  };
  return io::WriteSafetensors(out, tensors, metadata);
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Writes the f64 loss and parameter gradients of a batch (for the torch reference test).");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = sg::Run(); !s.ok()) {
    std::fprintf(stderr, "grad_dump: error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
