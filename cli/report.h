// What cli:train shows and writes about a run besides training itself:
//   - the progress line, rewritten in place on a terminal and absent otherwise (stdout not a TTY: only the
//     summary is printed);
//   - held-out evaluation (core/eval.h) every --eval_every steps: loss, perplexity, accuracy and, on the synthetic
//     retrieval task, accuracy by key-query distance;
//   - the --report JSON: the run's summary fields plus "metrics" (one object per step: loss, lr, grad_norm,
//     tokens/s, the step's peak memory by category, and the evaluation where one ran), "evals", "memory_timeline";
//   - SVG plots next to the report: the loss curve (train and eval), accuracy vs distance, and memory by category
//     over one step (the engine's MemoryTracker timeline).
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "base/memory.h"
#include "core/data.h"
#include "core/eval.h"
#include "core/trainer.h"

ABSL_DECLARE_FLAG(int64_t, eval_every);
ABSL_DECLARE_FLAG(std::string, eval_data);
ABSL_DECLARE_FLAG(int64_t, eval_sequences);

namespace sg::tools {

// The progress line: on a terminal one line rewritten in place (\r), with notes (evaluations) printed as lines
// above it; elsewhere nothing at all.
class Progress {
 public:
  Progress(FILE* out, bool tty) : out_(out), tty_(tty) {}
  // stdout, on when stdout is a terminal.
  static Progress ForStdout();
  bool tty() const { return tty_; }
  void Update(const std::string& line);
  void Note(const std::string& line);
  // Ends the progress line (a newline if one is showing).
  void Finish();

 private:
  FILE* out_;
  bool tty_;
  std::string line_;  // the line showing ("" = none)
};

// One optimizer step as the report records it.
struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;            // NaN: not known
  double grad_norm = 0;     // before clipping; NaN: not known
  int64_t tokens = 0;       // input tokens of the step's batch
  double seconds = 0;       // wall time of the step
  double tokens_per_s = 0;  // of this step
  int64_t peak_bytes = 0;   // peak of the step (MemoryTracker's window)
  std::array<int64_t, kNumMemCategories> peak_bytes_by_category{};
};

struct EvalRecord {
  int64_t step = 0;
  EvalResult result;
};

// The bytes in use per category after every allocation and release of one step.
struct MemoryTimeline {
  int64_t step = 0;
  std::vector<MemoryEvent> events;
  int64_t dropped = 0;  // events past the tracker's cap
};

// The records of a run and what is made of them.
class RunReport {
 public:
  void AddStep(const StepRecord& r) { steps_.push_back(r); }
  void AddEval(int64_t step, const EvalResult& r) { evals_.push_back({step, r}); }
  void SetMemoryTimeline(MemoryTimeline t) { timeline_ = std::move(t); }
  // Accuracy plots draw a dashed line at this level (e.g. 1 / values of the retrieval task); NaN: none.
  void set_chance(double c) { chance_ = c; }

  const std::vector<StepRecord>& steps() const { return steps_; }
  const std::vector<EvalRecord>& evals() const { return evals_; }
  const MemoryTimeline& timeline() const { return timeline_; }
  bool has_distances() const;

  // summary_json: the run's JSON object (model, strategy, ... losses), kept as it is; the result adds "metrics",
  // "evals", "memory_timeline" (at most max_timeline_points points, each the largest total of its span) and
  // "plots" (the file names written next to the report).
  absl::StatusOr<std::string> Json(const std::string& summary_json, const std::vector<std::string>& plots,
                                   int64_t max_timeline_points = 1000) const;

  // The plots, standalone SVG documents; `title` heads each one.
  std::string LossSvg(const std::string& title) const;
  std::string AccuracySvg(const std::string& title) const;  // needs has_distances()
  std::string MemorySvg(const std::string& title) const;

  // Writes the plots next to report_path (PlotPath) and the report itself; the accuracy plot only when
  // has_distances().
  absl::Status Write(const std::string& report_path, const std::string& summary_json, const std::string& title) const;

 private:
  std::vector<StepRecord> steps_;
  std::vector<EvalRecord> evals_;
  MemoryTimeline timeline_;
  double chance_ = std::numeric_limits<double>::quiet_NaN();
};

// Where a plot goes: next to the report, the report's name without ".json" plus "." name ".svg"
// (out/run.json, "loss" -> out/run.loss.svg).
std::string PlotPath(const std::string& report_path, const std::string& name);

// At most max_points events of a timeline: each the one with the largest total in its span, plus the first and
// the last (so the peak survives).
std::vector<MemoryEvent> DownsampleTimeline(const std::vector<MemoryEvent>& events, int64_t max_points);

// One line for an evaluation: "loss 1.3850  ppl 3.99  acc 0.268 (8 seqs, 1024 labels)".
std::string EvalLine(const EvalResult& r);

// cli:train's hooks: progress, per-step records, evaluation when due, the memory timeline of the last step,
// the summary's evaluation lines and the report.
class TrainMonitor {
 public:
  TrainMonitor(Trainer& trainer, int64_t steps, Progress progress = Progress::ForStdout());

  // Evaluation from the flags: the held-out set is --eval_data (loaded like --data: .jsonl, or a .bin of
  // data_dtype) or, when task is given (the synthetic task), --eval_sequences sequences of it from an index range
  // training never draws. Enabled by --eval_every > 0 or --eval_data; sft only.
  absl::Status SetUpEval(const std::string& objective, const RetrievalTask* task, uint64_t seed, int64_t seq_len,
                         const std::string& data_dtype);
  void SetEvalSet(EvalSet set, int64_t every) {
    eval_set_ = std::move(set);
    eval_every_ = every;
  }
  bool eval_enabled() const { return !eval_set_.sequences.empty(); }
  // The step the run stops at when that is before `steps` (e.g. --stop_at_step): the memory timeline and the final
  // evaluation happen there.
  void set_last_step(int64_t step) { last_step_ = step; }

  // Before the trainer's step: restarts the memory window; records the allocation timeline on the last step.
  void BeginStep(int64_t step);
  // After it: records the step, updates the progress line, evaluates when due (exits on an evaluation error).
  void EndStep(int64_t step, const StepMetrics& m, double lr, int64_t batch_tokens, double step_seconds,
               double mean_tokens_per_s);
  // After the last step: ends the progress line.
  void FinishProgress() { progress_.Finish(); }
  // The last evaluation for the summary (to stdout): a line, and per distance bucket its accuracy.
  void PrintEvalSummary(FILE* out) const;
  absl::Status WriteReport(const std::string& path, const std::string& summary_json) const;

  RunReport& report() { return report_; }

 private:
  void RunEval(int64_t step);
  Trainer& trainer_;
  int64_t steps_, last_step_;
  Progress progress_;
  RunReport report_;
  EvalSet eval_set_;
  int64_t eval_every_ = 0;
  std::string title_;
};

}  // namespace sg::tools
