#include "cli/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/common.h"
#include "cli/svg_chart.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int64_t, eval_every, 0,
          "evaluate on held-out data every N steps and after the last (0 = only after the last, and only with "
          "--eval_data); sft only");
ABSL_FLAG(std::string, eval_data, "",
          "held-out token data for evaluation, in --data's formats (.jsonl or .bin with --data_dtype); empty with the "
          "synthetic task: held-out sequences of the task");
ABSL_FLAG(int64_t, eval_sequences, 8,
          "held-out sequences to evaluate: of the synthetic task, or the first N of --eval_data (0 = all of it)");

namespace sg::tools {

namespace {
using OJson = nlohmann::ordered_json;

double NaN() { return std::numeric_limits<double>::quiet_NaN(); }

// A finite number, or null (JSON has no NaN).
OJson Number(double v) { return std::isfinite(v) ? OJson(v) : OJson(nullptr); }

OJson CategoriesJson(const std::array<int64_t, kNumMemCategories>& bytes) {
  OJson j = OJson::object();
  for (int i = 0; i < kNumMemCategories; ++i) j[MemCategoryName(static_cast<MemCategory>(i))] = bytes[i];
  return j;
}

OJson EvalJson(const EvalResult& r) {
  OJson j = OJson::object();
  j["loss"] = Number(r.loss());
  j["perplexity"] = Number(r.perplexity());
  j["accuracy"] = Number(r.accuracy());
  j["sequences"] = r.sequences;
  j["tokens"] = r.tokens;
  if (!r.by_distance.empty()) {
    OJson buckets = OJson::array();
    for (const DistanceBucketStats& b : r.by_distance) {
      if (b.count == 0) continue;
      buckets.push_back({{"distance_min", b.lo},
                         {"distance_max", b.hi - 1},
                         {"count", b.count},
                         {"correct", b.correct},
                         {"accuracy", Number(b.accuracy())},
                         {"loss", Number(b.loss())}});
    }
    j["accuracy_by_distance"] = std::move(buckets);
  }
  return j;
}

// Accuracy plots leave out buckets with fewer labels than this (their accuracy is mostly noise); the JSON has all.
constexpr int64_t kMinBucketLabels = 10;

std::string Mib(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

std::string BucketName(const DistanceBucketStats& b) {
  return b.hi - b.lo == 1 ? absl::StrCat(b.lo) : absl::StrCat(b.lo, "-", b.hi - 1);
}

}  // namespace

// ---- Progress ----

Progress Progress::ForStdout() { return Progress(stdout, isatty(fileno(stdout)) == 1); }

void Progress::Update(const std::string& line) {
  if (!tty_) return;
  // Pad over the rest of a longer previous line.
  const size_t pad = line_.size() > line.size() ? line_.size() - line.size() : 0;
  std::fprintf(out_, "\r%s%s", line.c_str(), std::string(pad, ' ').c_str());
  std::fflush(out_);
  line_ = line;
}

void Progress::Note(const std::string& line) {
  if (!tty_) return;
  std::fprintf(out_, "\r%s%s\n", line.c_str(),
               std::string(line_.size() > line.size() ? line_.size() - line.size() : 0, ' ').c_str());
  if (!line_.empty()) std::fprintf(out_, "%s", line_.c_str());
  std::fflush(out_);
}

void Progress::Finish() {
  if (!tty_ || line_.empty()) return;
  std::fprintf(out_, "\n");
  std::fflush(out_);
  line_.clear();
}

// ---- RunReport ----

bool RunReport::has_distances() const {
  for (const EvalRecord& e : evals_)
    if (!e.result.by_distance.empty()) return true;
  return false;
}

std::string PlotPath(const std::string& report_path, const std::string& name) {
  std::string stem = report_path;
  if (absl::EndsWith(stem, ".json")) stem.resize(stem.size() - 5);
  return absl::StrCat(stem, ".", name, ".svg");
}

std::vector<MemoryEvent> DownsampleTimeline(const std::vector<MemoryEvent>& events, int64_t max_points) {
  const int64_t n = static_cast<int64_t>(events.size());
  if (n <= std::max<int64_t>(max_points, 3)) return events;
  auto total = [](const MemoryEvent& e) {
    int64_t t = 0;
    for (int64_t b : e.current) t += b;
    return t;
  };
  const int64_t spans = std::max<int64_t>(1, max_points - 2);
  std::vector<MemoryEvent> out = {events.front()};
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t lo = 1 + (n - 2) * s / spans, hi = 1 + (n - 2) * (s + 1) / spans;
    if (lo >= hi) continue;
    int64_t best = lo;
    for (int64_t i = lo + 1; i < hi; ++i)
      if (total(events[i]) > total(events[best])) best = i;
    out.push_back(events[best]);
  }
  out.push_back(events.back());
  return out;
}

absl::StatusOr<std::string> RunReport::Json(const std::string& summary_json, const std::vector<std::string>& plots,
                                            int64_t max_timeline_points) const {
  OJson j;
  try {
    j = OJson::parse(summary_json);
  } catch (const nlohmann::json::exception& e) {
    return absl::InternalError(absl::StrCat("report summary is not JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InternalError("report summary is not a JSON object");

  size_t next_eval = 0;
  OJson metrics = OJson::array();
  for (const StepRecord& r : steps_) {
    OJson m = OJson::object();
    m["step"] = r.step;
    m["loss"] = Number(r.loss);
    m["lr"] = Number(r.lr);
    m["grad_norm"] = Number(r.grad_norm);
    m["tokens"] = r.tokens;
    m["seconds"] = Number(r.seconds);
    m["tokens_per_s"] = Number(r.tokens_per_s);
    m["peak_bytes"] = r.peak_bytes;
    m["peak_bytes_by_category"] = CategoriesJson(r.peak_bytes_by_category);
    while (next_eval < evals_.size() && evals_[next_eval].step < r.step) ++next_eval;
    if (next_eval < evals_.size() && evals_[next_eval].step == r.step) m["eval"] = EvalJson(evals_[next_eval].result);
    metrics.push_back(std::move(m));
  }
  j["metrics"] = std::move(metrics);

  OJson evals = OJson::array();
  for (const EvalRecord& e : evals_) {
    OJson x = OJson::object();
    x["step"] = e.step;
    const OJson r = EvalJson(e.result);
    for (auto it = r.begin(); it != r.end(); ++it) x[it.key()] = it.value();
    evals.push_back(std::move(x));
  }
  j["evals"] = std::move(evals);

  if (!timeline_.events.empty()) {
    const std::vector<MemoryEvent> pts = DownsampleTimeline(timeline_.events, max_timeline_points);
    OJson t = OJson::object();
    t["step"] = timeline_.step;
    t["events"] = static_cast<int64_t>(timeline_.events.size()) + timeline_.dropped;
    t["events_dropped"] = timeline_.dropped;
    OJson index = OJson::array();
    for (const MemoryEvent& e : pts) index.push_back(e.index);
    t["event_index"] = std::move(index);
    OJson bytes = OJson::object();
    for (int c = 0; c < kNumMemCategories; ++c) {
      OJson col = OJson::array();
      for (const MemoryEvent& e : pts) col.push_back(e.current[c]);
      bytes[MemCategoryName(static_cast<MemCategory>(c))] = std::move(col);
    }
    t["bytes_by_category"] = std::move(bytes);
    j["memory_timeline"] = std::move(t);
  }
  j["plots"] = plots;
  return j.dump() + "\n";
}

std::string RunReport::LossSvg(const std::string& title) const {
  svg::LineChart chart;
  chart.set_title(absl::StrCat("Loss: ", title)).set_x_label("step").set_y_label("loss (nats per label)");
  chart.set_size(720, 420).set_y_from_zero(false).set_legend(svg::LineChart::Legend::kTopRight);
  // Long runs: every step in a light colour under the mean of the last `window` steps.
  const int64_t window = static_cast<int64_t>(steps_.size()) >= 100 ? static_cast<int64_t>(steps_.size()) / 50 : 1;
  svg::Series train{window > 1 ? "train (every step)" : "train", {}, window > 1 ? "#9ecae1" : svg::Palette(0), false,
                    false};
  for (const StepRecord& r : steps_) train.points.emplace_back(static_cast<double>(r.step), r.loss);
  chart.AddSeries(train);
  if (window > 1) {
    svg::Series mean{absl::StrCat("train (mean of ", window, " steps)"), {}, svg::Palette(0), false, false};
    double sum = 0;
    for (size_t i = 0; i < steps_.size(); ++i) {
      sum += steps_[i].loss;
      if (i >= static_cast<size_t>(window)) sum -= steps_[i - window].loss;
      if (i + 1 >= static_cast<size_t>(window))
        mean.points.emplace_back(static_cast<double>(steps_[i].step), sum / static_cast<double>(window));
    }
    chart.AddSeries(mean);
  }
  if (!evals_.empty()) {
    svg::Series eval{"held-out eval", {}, svg::Palette(1), false, true};
    for (const EvalRecord& e : evals_) eval.points.emplace_back(static_cast<double>(e.step), e.result.loss());
    chart.AddSeries(eval);
  }
  return chart.ToSvg();
}

std::string RunReport::AccuracySvg(const std::string& title) const {
  svg::LineChart chart;
  chart.set_title(absl::StrCat("Retrieval accuracy vs key-query distance: ", title))
      .set_x_label(absl::StrCat("distance from the key's pair token to the query (tokens; buckets [2^k, 2^(k+1)) with >= ",
                                kMinBucketLabels, " labels)"))
      .set_y_label("accuracy (arg max = value)")
      .set_log2_x(true)
      .set_y_range(0, 1)
      .set_legend(svg::LineChart::Legend::kOutsideRight)
      .set_size(900, 420);
  // At most four evaluations: evenly spaced, always the last.
  std::vector<size_t> picked;
  std::vector<size_t> with;
  for (size_t i = 0; i < evals_.size(); ++i)
    if (!evals_[i].result.by_distance.empty()) with.push_back(i);
  const size_t shown = std::min<size_t>(4, with.size());
  for (size_t k = 0; k < shown; ++k) picked.push_back(with[shown == 1 ? with.size() - 1
                                                                     : (with.size() - 1) * k / (shown - 1)]);
  picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
  int color = 0;
  for (size_t i : picked) {
    const EvalRecord& e = evals_[i];
    svg::Series s{absl::StrFormat("step %d (overall %.3f)", e.step, e.result.accuracy()), {}, svg::Palette(color++),
                  false, true};
    for (const DistanceBucketStats& b : e.result.by_distance)
      if (b.count >= kMinBucketLabels) s.points.emplace_back(static_cast<double>(b.lo), b.accuracy());
    chart.AddSeries(s);
  }
  if (std::isfinite(chance_) && !picked.empty()) {
    double lo = 0, hi = 0;
    for (const DistanceBucketStats& b : evals_[picked.back()].result.by_distance)
      if (b.count >= kMinBucketLabels) {
        if (lo == 0) lo = static_cast<double>(b.lo);
        hi = static_cast<double>(b.lo);
      }
    chart.AddSeries({absl::StrFormat("value prior only (%.2f)", chance_), {{lo, chance_}, {hi, chance_}}, "#999999",
                     true, false});
  }
  return chart.ToSvg();
}

std::string RunReport::MemorySvg(const std::string& title) const {
  svg::LineChart chart;
  chart.set_title(absl::StrCat("Memory by category over step ", timeline_.step, ": ", title))
      .set_x_label(absl::StrCat("allocation / release event (", timeline_.events.size() + timeline_.dropped,
                                " in the step)"))
      .set_y_label("MiB in use (engine accounting)")
      .set_stacked(true)
      .set_legend(svg::LineChart::Legend::kOutsideRight)
      .set_size(820, 440);
  const std::vector<MemoryEvent> pts = DownsampleTimeline(timeline_.events, 1500);
  for (int c = 0; c < kNumMemCategories; ++c) {
    bool any = false;
    for (const MemoryEvent& e : pts) any |= e.current[c] != 0;
    if (!any) continue;
    svg::Series s{MemCategoryName(static_cast<MemCategory>(c)), {}, svg::Palette(c), false, false};
    for (const MemoryEvent& e : pts) s.points.emplace_back(static_cast<double>(e.index), e.current[c] / 1048576.0);
    chart.AddSeries(s);
  }
  return chart.ToSvg();
}

absl::Status RunReport::Write(const std::string& report_path, const std::string& summary_json,
                              const std::string& title) const {
  std::vector<std::pair<std::string, std::string>> plots = {{"loss", LossSvg(title)}};
  if (has_distances()) plots.emplace_back("accuracy", AccuracySvg(title));
  if (!timeline_.events.empty()) plots.emplace_back("memory", MemorySvg(title));
  std::vector<std::string> names;
  for (const auto& [name, svg] : plots) {
    const std::string path = PlotPath(report_path, name);
    if (absl::Status s = WriteTextFile(path, svg); !s.ok()) return s;
    names.push_back(path.substr(path.find_last_of('/') + 1));
  }
  absl::StatusOr<std::string> json = Json(summary_json, names);
  if (!json.ok()) return json.status();
  return WriteTextFile(report_path, *json);
}

std::string EvalLine(const EvalResult& r) {
  return absl::StrFormat("loss %.4f  ppl %.2f  acc %.3f (%d seqs, %d labels)", r.loss(), r.perplexity(),
                         r.accuracy(), r.sequences, r.tokens);
}

// ---- TrainMonitor ----

TrainMonitor::TrainMonitor(Trainer& trainer, int64_t steps, Progress progress)
    : trainer_(trainer), steps_(steps), last_step_(steps), progress_(progress) {}

absl::Status TrainMonitor::SetUpEval(const std::string& objective, const RetrievalTask* task, uint64_t seed,
                                     int64_t seq_len, const std::string& data_dtype) {
  const int64_t every = absl::GetFlag(FLAGS_eval_every);
  const std::string data = absl::GetFlag(FLAGS_eval_data);
  const int64_t count = absl::GetFlag(FLAGS_eval_sequences);
  if (every < 0) return absl::InvalidArgumentError(absl::StrCat("--eval_every must be >= 0, got ", every));
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("--eval_sequences must be >= 0, got ", count));
  if (every == 0 && data.empty()) return absl::OkStatus();
  if (objective != "sft")
    return absl::InvalidArgumentError(absl::StrCat("--eval_every and --eval_data evaluate token loss and accuracy: "
                                                   "--objective=sft only, not ", objective));
  EvalSet set;
  if (!data.empty()) {
    const std::string path = ResolveUserPath(data);
    const int64_t vocab = trainer_.model().vocab_size();
    absl::StatusOr<std::vector<Sequence>> loaded;
    if (absl::EndsWith(path, ".jsonl")) {
      absl::StatusOr<Overlong> overlong = ParseOverlong(absl::GetFlag(FLAGS_overlong));
      if (!overlong.ok()) return overlong.status();
      loaded = LoadJsonl(path, seq_len, vocab, absl::GetFlag(FLAGS_max_line_bytes), *overlong);
    } else {
      if (data_dtype != "uint16" && data_dtype != "uint32")
        return absl::InvalidArgumentError("--data_dtype must be uint16 or uint32");
      loaded = LoadTokenBin(path, data_dtype == "uint16" ? 2 : 4, seq_len, vocab, absl::GetFlag(FLAGS_doc_sep_token));
    }
    if (!loaded.ok()) return absl::Status(loaded.status().code(), absl::StrCat("--eval_data: ", loaded.status().message()));
    set.sequences = std::move(*loaded);
    if (count > 0 && static_cast<int64_t>(set.sequences.size()) > count) set.sequences.resize(count);
  } else if (task) {
    if (count == 0) return absl::InvalidArgumentError("--eval_sequences must be positive for the synthetic task");
    set = HeldOutRetrieval(*task, seed, count);
    report_.set_chance(1.0 / static_cast<double>(task->num_values));
  } else {
    return absl::InvalidArgumentError(
        "--eval_every needs --eval_data (held-out token data) when training on --data");
  }
  SetEvalSet(std::move(set), every);
  return absl::OkStatus();
}

void TrainMonitor::BeginStep(int64_t step) {
  MemoryTracker& mem = trainer_.model().memory();
  mem.ResetWindow();
  if (step == last_step_) mem.StartTimeline();
}

void TrainMonitor::EndStep(int64_t step, const StepMetrics& m, double lr, int64_t batch_tokens, double step_seconds,
                           double mean_tokens_per_s) {
  MemoryTracker& mem = trainer_.model().memory();
  if (step == last_step_) {
    MemoryTimeline t;
    t.step = step;
    t.events = mem.StopTimeline(&t.dropped);
    report_.SetMemoryTimeline(std::move(t));
  }
  const MemorySnapshot snap = mem.Snapshot();
  StepRecord r;
  r.step = step;
  r.loss = m.loss;
  r.lr = lr;
  r.grad_norm = m.grad_norm;
  r.tokens = batch_tokens;
  r.seconds = step_seconds;
  r.tokens_per_s = step_seconds > 0 ? static_cast<double>(batch_tokens) / step_seconds : NaN();
  r.peak_bytes = snap.window_total_peak;
  r.peak_bytes_by_category = snap.window_peak;
  report_.AddStep(r);

  std::string line = absl::StrFormat("step %d/%d  loss %.4f", step, steps_, m.loss);
  if (std::isfinite(lr)) absl::StrAppend(&line, absl::StrFormat("  lr %.2e", lr));
  absl::StrAppend(&line, absl::StrFormat("  %.0f tok/s  peak %s", mean_tokens_per_s, Mib(snap.total_peak)));
  if (!report_.evals().empty())
    absl::StrAppend(&line, absl::StrFormat("  eval %.4f", report_.evals().back().result.loss()));
  progress_.Update(line);
  if (eval_enabled() && (step == last_step_ || (eval_every_ > 0 && step % eval_every_ == 0))) RunEval(step);
}

void TrainMonitor::RunEval(int64_t step) {
  absl::StatusOr<EvalResult> r = Evaluate(trainer_.model(), eval_set_, trainer_.strategy());
  if (!r.ok()) {
    progress_.Finish();
    ExitIfError(r.status(), absl::StrCat("evaluation at step ", step).c_str());
  }
  report_.AddEval(step, *r);
  progress_.Note(absl::StrCat("eval @ step ", step, ": ", EvalLine(*r)));
}

void TrainMonitor::PrintEvalSummary(FILE* out) const {
  if (report_.evals().empty()) return;
  const EvalRecord& e = report_.evals().back();
  std::fprintf(out, "eval (held-out, step %lld): %s\n", static_cast<long long>(e.step), EvalLine(e.result).c_str());
  if (e.result.by_distance.empty()) return;
  std::string line = "  accuracy by key-query distance:";
  for (const DistanceBucketStats& b : e.result.by_distance)
    if (b.count > 0) absl::StrAppend(&line, absl::StrFormat(" %s: %.2f (%d)", BucketName(b), b.accuracy(), b.count));
  std::fprintf(out, "%s\n", line.c_str());
}

absl::Status TrainMonitor::WriteReport(const std::string& path, const std::string& summary_json) const {
  std::string title;
  try {
    const nlohmann::json j = nlohmann::json::parse(summary_json);
    title = absl::StrCat(j.value("model", std::string("?")), ", ", j.value("strategy", std::string("?")),
                         ", seq_len ", j.value("seq_len", int64_t{0}));
  } catch (const nlohmann::json::exception& e) {
    return absl::InternalError(absl::StrCat("report summary is not JSON: ", e.what()));
  }
  return report_.Write(path, summary_json, title);
}

}  // namespace sg::tools
