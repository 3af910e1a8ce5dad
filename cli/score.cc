// Per-token log-probabilities of token data under a model (preset or HF directory, optionally with a PEFT adapter),
// by the engine's chunked forward pass (--chunk tokens at a time, --lm_chunk rows of logits: never a sequence x
// vocabulary array), as JSONL, one line per input record:
//   sft (.jsonl {"input_ids", "labels"} or a .bin token file, as cli:train reads them):
//     {"logprobs": [...], "sum": s, "tokens": n}, logprobs aligned with input_ids (Hugging Face's convention):
//     entry t = log p(labels[t] | input_ids[0..t)), null at t = 0 and where the label is -100
//   dpo (train's pair format): {"chosen_logp": x, "rejected_logp": y}, each summed over the response's tokens: what
//     the pair format's ref_chosen_logp / ref_rejected_logp take
//   grpo (train's group format): {"logprobs": [[...], ...]}, per completion one log-prob per completion token: what
//     the group format's old_logprobs / ref_logprobs take
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/common.h"
#include "core/data.h"
#include "core/model_io.h"
#include "core/objective.h"
#include "core/trainer.h"

ABSL_FLAG(std::string, data, "",
          "the records to score: sft (default --objective) a .jsonl of {\"input_ids\", \"labels\"} or a headerless "
          ".bin token file (--data_dtype, cut into windows of --seq_len + 1 tokens); dpo and grpo their JSONL "
          "formats (docs/objectives.md)");
ABSL_FLAG(std::string, data_dtype, "uint16", "element type of a .bin token file: uint16 or uint32");
ABSL_FLAG(int64_t, seq_len, 0,
          "sft: .bin windows of seq_len + 1 tokens (required for .bin); a .jsonl record longer than seq_len + 1 is "
          "cut there; 0 = .jsonl records whole");
ABSL_FLAG(std::string, out, "-", "where the JSONL goes (written atomically); - = standard output");

namespace sg {
namespace {

// JSON for a double: every digit, null for NaN.
std::string Num(double x) { return std::isnan(x) ? "null" : absl::StrFormat("%.17g", x); }

// The engine's per-position log-probs of a sequence (position t: of its label, the token at t + 1).
std::vector<double> EngineLogprobs(Trainer& trainer, const Sequence& s) {
  absl::StatusOr<std::vector<double>> lp = trainer.TokenLogprobs(trainer.model(), s);
  tools::ExitIfError(lp.status(), "scoring");
  return *std::move(lp);
}

struct Totals {
  int64_t records = 0, tokens = 0;
  double sum = 0;
  void Add(double lp) {
    ++tokens;
    sum += lp;
  }
};

// sft: aligned with the record's input_ids, whose first token no position predicts.
std::string ScoreSequence(Trainer& trainer, const Sequence& s, Totals* totals) {
  const std::vector<double> lp = EngineLogprobs(trainer, s);
  std::string line = "{\"logprobs\": [null";
  double sum = 0;
  int64_t tokens = 0;
  for (size_t t = 0; t < lp.size(); ++t) {
    const bool labelled = s.labels[t] >= 0;
    absl::StrAppend(&line, ", ", labelled ? Num(lp[t]) : "null");
    if (!labelled) continue;
    sum += lp[t];
    ++tokens;
    totals->Add(lp[t]);
  }
  absl::StrAppend(&line, "], \"sum\": ", Num(sum), ", \"tokens\": ", tokens, "}\n");
  return line;
}

// dpo, grpo: the log-probs of a response's tokens (the labelled positions of prompt + response, in order).
std::vector<double> ResponseLogprobs(Trainer& trainer, const Sequence& s, Totals* totals) {
  const std::vector<double> lp = EngineLogprobs(trainer, s);
  std::vector<double> out;
  for (size_t t = 0; t < lp.size(); ++t)
    if (s.labels[t] >= 0) {
      out.push_back(lp[t]);
      totals->Add(lp[t]);
    }
  return out;
}

double Sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

int Main() {
  absl::StatusOr<DType> dtype = tools::ParseDType(absl::GetFlag(FLAGS_dtype));
  tools::ExitIfError(dtype.status(), "flags");
  const Device device = tools::DeviceFromFlags();
  const StrategyOptions strategy = tools::StrategyFromFlags();
  tools::ExitIfError(ValidateStrategyOptions(strategy), "flags");
  const ObjectiveOptions objective = tools::ObjectiveFromFlags();
  tools::ExitIfError(ValidateObjectiveOptions(objective), "flags");
  const std::string data = tools::ResolveUserPath(absl::GetFlag(FLAGS_data));
  if (data.empty()) tools::ExitIfError(absl::InvalidArgumentError("is required: the records to score"), "--data");
  const int64_t seq_len = absl::GetFlag(FLAGS_seq_len);
  if (seq_len < 0)
    tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("got ", seq_len, "; need >= 0")), "--seq_len");
  absl::StatusOr<std::unique_ptr<Model>> model =
      LoadAnyModel(tools::ModelSpec(), *dtype, absl::GetFlag(FLAGS_seed), device, /*frozen_base=*/true);
  tools::ExitIfError(model.status(), "--model");
  const std::string lora = tools::ApplyLoraFlags(**model);
  if (!lora.empty()) std::fprintf(stderr, "%s\n", lora.c_str());
  const int64_t vocab = (*model)->vocab_size();
  Trainer trainer(**model, strategy, OptimizerOptions{});
  const auto t0 = std::chrono::steady_clock::now();
  Totals totals;
  std::string out;
  if (objective.name == "dpo") {
    absl::StatusOr<std::vector<DpoPair>> pairs = LoadDpoJsonl(data, vocab);
    tools::ExitIfError(pairs.status(), "--data");
    for (const DpoPair& p : *pairs) {
      const double chosen = Sum(ResponseLogprobs(trainer, p.chosen, &totals));
      const double rejected = Sum(ResponseLogprobs(trainer, p.rejected, &totals));
      absl::StrAppend(&out, "{\"chosen_logp\": ", Num(chosen), ", \"rejected_logp\": ", Num(rejected), "}\n");
      ++totals.records;
    }
  } else if (objective.name == "grpo") {
    absl::StatusOr<std::vector<GrpoGroup>> groups = LoadGrpoJsonl(data, vocab);
    tools::ExitIfError(groups.status(), "--data");
    for (const GrpoGroup& g : *groups) {
      absl::StrAppend(&out, "{\"logprobs\": [");
      for (size_t i = 0; i < g.completions.size(); ++i) {
        absl::StrAppend(&out, i ? ", [" : "[");
        const std::vector<double> lp = ResponseLogprobs(trainer, g.completions[i].seq, &totals);
        for (size_t j = 0; j < lp.size(); ++j) absl::StrAppend(&out, j ? ", " : "", Num(lp[j]));
        absl::StrAppend(&out, "]");
      }
      absl::StrAppend(&out, "]}\n");
      ++totals.records;
    }
  } else {
    absl::StatusOr<std::vector<Sequence>> seqs;
    if (absl::EndsWith(data, ".jsonl")) {
      seqs = LoadJsonl(data, seq_len > 0 ? seq_len : std::numeric_limits<int64_t>::max() - 1, vocab,
                       kDefaultMaxLineBytes, Overlong::kTruncate);
    } else {
      const std::string t = absl::GetFlag(FLAGS_data_dtype);
      if (t != "uint16" && t != "uint32")
        tools::ExitIfError(absl::InvalidArgumentError(absl::StrCat("is '", t, "'; need uint16 or uint32")),
                           "--data_dtype");
      if (seq_len == 0)
        tools::ExitIfError(absl::InvalidArgumentError("a .bin token file needs --seq_len (its window length - 1)"),
                           "--seq_len");
      seqs = LoadTokenBin(data, t == "uint16" ? 2 : 4, seq_len, vocab, absl::GetFlag(FLAGS_doc_sep_token));
    }
    tools::ExitIfError(seqs.status(), "--data");
    for (const Sequence& s : *seqs) {
      absl::StrAppend(&out, ScoreSequence(trainer, s, &totals));
      ++totals.records;
    }
  }
  const std::string path = absl::GetFlag(FLAGS_out);
  if (path == "-") {
    std::fwrite(out.data(), 1, out.size(), stdout);
    if (std::fflush(stdout) != 0) tools::ExitIfError(absl::DataLossError("cannot write standard output"), "--out");
  } else {
    tools::ExitIfError(tools::WriteTextFile(tools::ResolveUserPath(path), out), "--out");
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "seqgrad score: %lld records, %lld tokens, mean log-prob %.6f, %.2f s\n",
               static_cast<long long>(totals.records), static_cast<long long>(totals.tokens),
               totals.tokens ? totals.sum / static_cast<double>(totals.tokens) : std::nan(""), secs);
  return 0;
}

}  // namespace
}  // namespace sg

int main(int argc, char** argv) {
  sg::tools::InitTool(argc, argv,
                      "Per-token log-probabilities of token data (sft records, dpo pairs, grpo groups) under a model, "
                      "as JSONL.\n  score --model=DIR --data=records.jsonl [--objective=grpo] [--lora_init=ADAPTER] "
                      "--out=logprobs.jsonl");
  return sg::tools::RunTool("score", sg::Main);
}
