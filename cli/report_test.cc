// The report pieces on their own: the progress line on and off a terminal, the report JSON around a run's summary,
// plot paths, timeline downsampling, the SVG plots' titles and structure, and the stacked chart.
#include "cli/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/svg_chart.h"
#include "nlohmann/json.hpp"

namespace sg::tools {
namespace {

std::string Contents(FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[256];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(ProgressTest, SilentWhenNotATerminal) {
  FILE* f = std::tmpfile();
  Progress p(f, /*tty=*/false);
  p.Update("step 1/3  loss 4.0");
  p.Note("eval @ step 1: loss 3.9");
  p.Update("step 2/3  loss 3.5");
  p.Finish();
  EXPECT_EQ(Contents(f), "");
  std::fclose(f);
}

TEST(ProgressTest, RewritesOneLineOnATerminal) {
  FILE* f = std::tmpfile();
  Progress p(f, /*tty=*/true);
  p.Update("step 1/3  loss 4.0000");
  p.Update("step 2/3  loss 3.5");        // shorter: padded over the old line
  p.Note("eval @ step 2: loss 3.4");     // a line of its own, then the progress line again
  p.Update("step 3/3  loss 3.2000");
  p.Finish();
  p.Finish();  // once only
  EXPECT_EQ(Contents(f),
            "\rstep 1/3  loss 4.0000"
            "\rstep 2/3  loss 3.5   "
            "\reval @ step 2: loss 3.4\nstep 2/3  loss 3.5"
            "\rstep 3/3  loss 3.2000\n");
  std::fclose(f);
}

EvalResult SomeEval(double loss_sum, int64_t correct) {
  EvalResult r;
  r.sequences = 2;
  r.tokens = 105;
  r.loss_sum = loss_sum;
  r.correct = correct;
  // [1, 2) empty, [8, 16) too small to plot
  r.by_distance = {{1, 2, 0, 0, 0.0}, {2, 4, 40, 30, 20.0}, {4, 8, 60, 10, 90.0}, {8, 16, 5, 5, 1.0}};
  return r;
}

RunReport ThreeSteps() {
  RunReport rep;
  for (int64_t s = 1; s <= 3; ++s) {
    StepRecord r;
    r.step = s;
    r.loss = 5.0 - s;
    r.lr = s == 1 ? std::nan("") : 1e-3;
    r.grad_norm = 0.5 * s;
    r.tokens = 100;
    r.seconds = 0.5;
    r.tokens_per_s = 200;
    r.peak_bytes = 1000 + s;
    r.peak_bytes_by_category[static_cast<int>(MemCategory::kActivations)] = 600 + s;
    rep.AddStep(r);
  }
  rep.AddEval(2, SomeEval(126.0, 42));
  rep.AddEval(3, SomeEval(115.5, 63));
  MemoryTimeline t;
  t.step = 3;
  for (int64_t i = 0; i < 50; ++i) {
    MemoryEvent e;
    e.index = i;
    e.current[static_cast<int>(MemCategory::kWeights)] = 1 << 20;
    e.current[static_cast<int>(MemCategory::kActivations)] = (i == 37 ? 9 : i % 5) << 20;
    t.events.push_back(e);
  }
  rep.SetMemoryTimeline(t);
  rep.set_chance(0.25);
  return rep;
}

const char* kSummary =
    "{\"model\": \"tiny\", \"objective\": \"sft\", \"strategy\": \"seco\", \"seq_len\": 600, \"chunk\": 128, "
    "\"steps\": 3, \"loss_first\": 4.0, \"loss_last\": 2.0, \"tokens_per_s\": 200.0, \"peak_bytes\": 1003, "
    "\"peak_bytes_by_category\": {\"weights\": 1}, \"losses\": [4.0, 3.0, 2.0]}";

TEST(RunReportTest, JsonKeepsTheSummaryAndAddsMetrics) {
  const RunReport rep = ThreeSteps();
  absl::StatusOr<std::string> text = rep.Json(kSummary, {"run.loss.svg"}, /*max_timeline_points=*/10);
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(*text);
  // The summary's fields first, in their order, unchanged.
  const std::vector<std::string> summary_keys = {"model",        "objective",  "strategy",
                                                 "seq_len",      "chunk",      "steps",
                                                 "loss_first",   "loss_last",  "tokens_per_s",
                                                 "peak_bytes",   "peak_bytes_by_category", "losses"};
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  ASSERT_GE(keys.size(), summary_keys.size());
  EXPECT_EQ(std::vector<std::string>(keys.begin(), keys.begin() + summary_keys.size()), summary_keys);
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["losses"].size(), 3u);

  const auto& m = j["metrics"];
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0]["step"], 1);
  EXPECT_TRUE(m[0]["lr"].is_null());  // NaN: not known
  EXPECT_EQ(m[1]["lr"], 1e-3);
  EXPECT_EQ(m[2]["grad_norm"], 1.5);
  EXPECT_EQ(m[2]["tokens_per_s"], 200.0);
  EXPECT_EQ(m[2]["peak_bytes"], 1003);
  EXPECT_EQ(m[2]["peak_bytes_by_category"]["activations"], 603);
  EXPECT_EQ(m[2]["peak_bytes_by_category"].size(), static_cast<size_t>(kNumMemCategories));
  EXPECT_FALSE(m[0].contains("eval"));
  ASSERT_TRUE(m[1].contains("eval"));
  EXPECT_DOUBLE_EQ(m[1]["eval"]["loss"].get<double>(), 1.2);
  EXPECT_DOUBLE_EQ(m[1]["eval"]["perplexity"].get<double>(), std::exp(1.2));
  EXPECT_DOUBLE_EQ(m[2]["eval"]["loss"].get<double>(), 1.1);
  EXPECT_DOUBLE_EQ(m[2]["eval"]["accuracy"].get<double>(), 0.6);
  const auto& buckets = m[2]["eval"]["accuracy_by_distance"];
  ASSERT_EQ(buckets.size(), 3u);  // the empty bucket is left out
  EXPECT_EQ(buckets[0]["distance_min"], 2);
  EXPECT_EQ(buckets[0]["distance_max"], 3);
  EXPECT_DOUBLE_EQ(buckets[0]["accuracy"].get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(buckets[1]["loss"].get<double>(), 1.5);

  ASSERT_EQ(j["evals"].size(), 2u);
  EXPECT_EQ(j["evals"][0]["step"], 2);
  EXPECT_EQ(j["evals"][1]["tokens"], 105);
  const auto& t = j["memory_timeline"];
  EXPECT_EQ(t["step"], 3);
  EXPECT_EQ(t["events"], 50);
  EXPECT_LE(t["event_index"].size(), 10u);
  int64_t peak = 0;
  for (const auto& b : t["bytes_by_category"]["activations"]) peak = std::max<int64_t>(peak, b.get<int64_t>());
  EXPECT_EQ(peak, 9 << 20);  // downsampling keeps the peak
  EXPECT_EQ(j["plots"], nlohmann::ordered_json::array({"run.loss.svg"}));

  EXPECT_FALSE(rep.Json("not json", {}).ok());
  EXPECT_FALSE(rep.Json("[1, 2]", {}).ok());
}

TEST(RunReportTest, PlotPaths) {
  EXPECT_EQ(PlotPath("out/run.json", "loss"), "out/run.loss.svg");
  EXPECT_EQ(PlotPath("/tmp/report", "memory"), "/tmp/report.memory.svg");
}

TEST(RunReportTest, DownsampleKeepsEndsAndPeaks) {
  std::vector<MemoryEvent> ev(1000);
  for (int64_t i = 0; i < 1000; ++i) {
    ev[i].index = i;
    ev[i].current[0] = i == 501 ? 100 : i % 7;
  }
  const std::vector<MemoryEvent> d = DownsampleTimeline(ev, 20);
  EXPECT_LE(d.size(), 20u);
  EXPECT_EQ(d.front().index, 0);
  EXPECT_EQ(d.back().index, 999);
  bool has_peak = false;
  for (size_t i = 0; i < d.size(); ++i) {
    has_peak |= d[i].index == 501;
    if (i > 0) {
      EXPECT_LT(d[i - 1].index, d[i].index);
    }
  }
  EXPECT_TRUE(has_peak);
  EXPECT_EQ(DownsampleTimeline(ev, 5000).size(), 1000u);
}

// Every element opened is closed (a cheap well-formedness check; the train test parses them as XML).
void ExpectBalanced(const std::string& svg) {
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_EQ(Count(svg, "<svg "), 1);
  EXPECT_EQ(Count(svg, "</svg>"), 1);
  EXPECT_EQ(Count(svg, "<g"), Count(svg, "</g>"));
  EXPECT_EQ(Count(svg, "<text"), Count(svg, "</text>"));
  EXPECT_EQ(Count(svg, "nan"), 0);
  EXPECT_EQ(Count(svg, "inf"), 0);
}

TEST(RunReportTest, Plots) {
  const RunReport rep = ThreeSteps();
  const std::string loss = rep.LossSvg("tiny, seco, seq_len 600");
  ExpectBalanced(loss);
  EXPECT_NE(loss.find("Loss: tiny, seco, seq_len 600"), std::string::npos);
  EXPECT_NE(loss.find("held-out eval"), std::string::npos);
  EXPECT_EQ(Count(loss, "<polyline"), 2);
  EXPECT_EQ(loss.find("mean of"), std::string::npos);  // short runs: no running mean

  RunReport long_run;
  for (int64_t s = 1; s <= 200; ++s) {
    StepRecord r;
    r.step = s;
    r.loss = 1 + (s % 2);
    long_run.AddStep(r);
  }
  const std::string smooth = long_run.LossSvg("t");
  ExpectBalanced(smooth);
  EXPECT_NE(smooth.find("train (mean of 4 steps)"), std::string::npos);
  EXPECT_NE(smooth.find("train (every step)"), std::string::npos);

  ASSERT_TRUE(rep.has_distances());
  const std::string acc = rep.AccuracySvg("t");
  ExpectBalanced(acc);
  EXPECT_NE(acc.find("Retrieval accuracy vs key-query distance: t"), std::string::npos);
  EXPECT_NE(acc.find("step 2 (overall 0.400)"), std::string::npos);
  EXPECT_NE(acc.find("step 3 (overall 0.600)"), std::string::npos);
  EXPECT_NE(acc.find("value prior only (0.25)"), std::string::npos);
  // Per evaluation a line through the two buckets with >= 10 labels (the 5-label one is left out); the prior.
  EXPECT_EQ(Count(acc, "<polyline"), 3);
  EXPECT_EQ(Count(acc, "<circle"), 4);

  const std::string mem = rep.MemorySvg("t");
  ExpectBalanced(mem);
  EXPECT_NE(mem.find("Memory by category over step 3: t"), std::string::npos);
  EXPECT_EQ(Count(mem, "<polygon"), 2);  // weights and activations; empty categories are left out
  EXPECT_NE(mem.find(">activations</text>"), std::string::npos);
  EXPECT_EQ(mem.find(">kv_cache</text>"), std::string::npos);
}

TEST(SvgChartTest, StackedBandsAddUp) {
  svg::LineChart chart;
  chart.set_stacked(true).set_size(400, 300);
  chart.AddSeries({"a", {{0, 1}, {1, 2}, {2, 1}}, ""});
  chart.AddSeries({"b", {{0, 3}, {2, 3}}, ""});  // no point at x = 1: 0 there
  const std::string s = chart.ToSvg();
  ExpectBalanced(s);
  EXPECT_EQ(Count(s, "<polygon"), 2);
  // The y axis spans the largest total, 4 (a + b at x = 0 and 2), not the largest single value.
  EXPECT_NE(s.find(">4</text>"), std::string::npos);
  EXPECT_EQ(s.find(">5</text>"), std::string::npos);
}

TEST(SvgChartTest, RequestedYRange) {
  svg::LineChart chart;
  chart.set_y_range(0, 1).AddSeries({"acc", {{1, 0.2}, {2, 0.3}}, ""});
  const std::string s = chart.ToSvg();
  EXPECT_NE(s.find(">1</text>"), std::string::npos);  // the axis reaches 1 although the data stop at 0.3
}

}  // namespace
}  // namespace sg::tools
