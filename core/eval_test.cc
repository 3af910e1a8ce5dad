// Evaluation: loss and perplexity against Trainer::EvaluateLoss; accuracy of the chunked arg max path against a
// brute-force T x vocab computation in f64 on both model families; distance buckets on hand-made sequences; the
// held-out retrieval set; the memory tracker's window peaks and timeline that reports plot.
#include "core/eval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "base/memory.h"
#include "core/data.h"
#include "core/model_io.h"
#include "core/trainer.h"

namespace sg {
namespace {

std::unique_ptr<Model> Load(const std::string& preset, uint64_t seed = 3) {
  absl::StatusOr<std::unique_ptr<Model>> m = LoadAnyModel(preset, DType::kF64, seed);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

// A small retrieval task that fits the tiny presets' vocabulary (97).
RetrievalTask SmallTask(int64_t seq_len = 70) {
  RetrievalTask t;
  t.seq_len = seq_len;
  t.vocab = 97;
  t.num_keys = 4;
  t.num_values = 4;
  t.num_queries = 8;
  EXPECT_TRUE(t.Validate().ok());
  return t;
}

StrategyOptions Chunked() {
  StrategyOptions o;
  o.chunk = 9;  // not a multiple of the page or the head's rows
  o.page_size = 4;
  o.lm_chunk = 5;
  return o;
}

// Brute force: every position's log-softmax over the whole vocabulary, the sequence in one chunk and all its rows
// of logits at once (one pass per vocabulary entry v, labelling every position with v), as a T x vocab table.
std::vector<std::vector<double>> FullLogprobs(Model& m, const Sequence& s) {
  const int64_t T = static_cast<int64_t>(s.ids.size()), V = m.vocab_size();
  StrategyOptions whole;
  whole.chunk = T;
  whole.page_size = T;
  whole.lm_chunk = T;
  std::vector<std::vector<double>> table(T, std::vector<double>(V));
  for (int64_t v = 0; v < V; ++v) {
    Sequence all_v{s.ids, std::vector<int32_t>(T, static_cast<int32_t>(v))};
    absl::StatusOr<TokenPredictions> p = PredictTokens(m, all_v, whole);
    EXPECT_TRUE(p.ok()) << p.status();
    for (int64_t t = 0; t < T; ++t) table[t][v] = p->logp[t];
  }
  return table;
}

int32_t ArgmaxOf(const std::vector<double>& row) {
  int32_t best = 0;
  for (size_t j = 1; j < row.size(); ++j)
    if (row[j] > row[best]) best = static_cast<int32_t>(j);
  return best;
}

class EvalFamilyTest : public ::testing::TestWithParam<std::string> {};

// Perplexity is exp of the mean token loss, and that loss is Trainer::EvaluateLoss's over the same sequences.
TEST_P(EvalFamilyTest, LossAndPerplexityMatchEvaluateLoss) {
  auto model = Load(GetParam());
  const EvalSet set = HeldOutRetrieval(SmallTask(), 5, 3);
  const StrategyOptions o = Chunked();
  absl::StatusOr<EvalResult> r = Evaluate(*model, set, o);
  ASSERT_TRUE(r.ok()) << r.status();
  Trainer trainer(*model, o, {});
  absl::StatusOr<StepMetrics> ref = trainer.EvaluateLoss(set.sequences);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(r->sequences, 3);
  EXPECT_EQ(r->tokens, ref->tokens);
  EXPECT_EQ(r->tokens, 3 * 8);
  EXPECT_NEAR(r->loss(), ref->loss, 1e-12);
  EXPECT_NEAR(r->perplexity(), std::exp(ref->loss), 1e-12 * std::exp(ref->loss));
  // Buckets partition the labelled positions.
  int64_t count = 0, correct = 0;
  double loss_sum = 0;
  for (const DistanceBucketStats& b : r->by_distance) {
    count += b.count;
    correct += b.correct;
    loss_sum += b.loss_sum;
  }
  EXPECT_EQ(count, r->tokens);
  EXPECT_EQ(correct, r->correct);
  EXPECT_NEAR(loss_sum, r->loss_sum, 1e-9);
}

// The chunked arg max (chunks of 9 tokens, 5 rows of logits at a time) equals the arg max of the brute-force
// T x vocab table at every labelled position, and so does the accuracy; a second copy of the sequence labelled
// with the brute-force arg max at every other query makes half of them correct.
TEST_P(EvalFamilyTest, ChunkedAccuracyMatchesBruteForce) {
  auto model = Load(GetParam());
  std::vector<int64_t> dist;
  const Sequence s = SmallTask().Make(11, 0, &dist);
  const std::vector<std::vector<double>> table = FullLogprobs(*model, s);
  absl::StatusOr<TokenPredictions> p = PredictTokens(*model, s, Chunked());
  ASSERT_TRUE(p.ok()) << p.status();
  int64_t labelled = 0, correct = 0;
  Sequence half = s;
  for (size_t t = 0; t < s.ids.size(); ++t) {
    if (s.labels[t] < 0) {
      EXPECT_EQ(p->argmax[t], -1);
      EXPECT_TRUE(std::isnan(p->logp[t]));
      continue;
    }
    const int32_t brute = ArgmaxOf(table[t]);
    EXPECT_EQ(p->argmax[t], brute) << "position " << t;
    EXPECT_NEAR(p->logp[t], table[t][s.labels[t]], 1e-12) << "position " << t;
    correct += brute == s.labels[t];
    half.labels[t] = labelled % 2 == 0 ? brute : (brute + 1) % static_cast<int32_t>(model->vocab_size());
    ++labelled;
  }
  EvalSet set{{s}, {dist}};
  absl::StatusOr<EvalResult> r = Evaluate(*model, set, Chunked());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->correct, correct);
  EXPECT_DOUBLE_EQ(r->accuracy(), static_cast<double>(correct) / static_cast<double>(labelled));

  absl::StatusOr<EvalResult> h = Evaluate(*model, EvalSet{{half}, {dist}}, Chunked());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tokens, labelled);
  EXPECT_EQ(h->correct, (labelled + 1) / 2);
}

INSTANTIATE_TEST_SUITE_P(Families, EvalFamilyTest, ::testing::Values("tiny", "tiny-ssm"));

TEST(DistanceBucketTest, PowersOfTwo) {
  EXPECT_EQ(DistanceBucket(1), 0);
  EXPECT_EQ(DistanceBucket(2), 1);
  EXPECT_EQ(DistanceBucket(3), 1);
  EXPECT_EQ(DistanceBucket(4), 2);
  EXPECT_EQ(DistanceBucket(7), 2);
  EXPECT_EQ(DistanceBucket(8), 3);
  EXPECT_EQ(DistanceBucket(1023), 9);
  EXPECT_EQ(DistanceBucket(1024), 10);
  EXPECT_EQ(DistanceBucketLow(3), 8);
  EXPECT_EQ(DistanceBucketHigh(3), 16);
}

// A hand-made sequence: labels at five positions with distances 1, 3, 2, 9, 12 and predictions right at the
// first, third and fifth.
TEST(DistanceBucketTest, HandMadeSequence) {
  Sequence s;
  s.ids.assign(10, 5);
  s.labels.assign(10, -100);
  const std::vector<int> at = {1, 3, 4, 7, 9};
  const std::vector<int32_t> label = {10, 11, 12, 13, 14};
  const std::vector<int64_t> dist = {1, 3, 2, 9, 12};
  TokenPredictions p;
  p.logp.assign(10, std::nan(""));
  p.argmax.assign(10, -1);
  const std::vector<double> logp = {-0.5, -1.0, -2.0, -3.0, -4.0};
  const std::vector<int32_t> predicted = {10, 0, 12, 0, 14};
  for (int k = 0; k < 5; ++k) {
    s.labels[at[k]] = label[k];
    p.logp[at[k]] = logp[k];
    p.argmax[at[k]] = predicted[k];
  }
  EvalResult r;
  ASSERT_TRUE(AccumulateEval(s, p, &dist, &r).ok());
  EXPECT_EQ(r.sequences, 1);
  EXPECT_EQ(r.tokens, 5);
  EXPECT_EQ(r.correct, 3);
  EXPECT_DOUBLE_EQ(r.loss(), 10.5 / 5);
  ASSERT_EQ(r.by_distance.size(), 4u);  // buckets [1,2) [2,4) [4,8) [8,16)
  const int64_t lo[] = {1, 2, 4, 8}, hi[] = {2, 4, 8, 16}, count[] = {1, 2, 0, 2}, correct[] = {1, 1, 0, 1};
  const double loss[] = {0.5, 3.0, 0.0, 7.0};
  for (int b = 0; b < 4; ++b) {
    EXPECT_EQ(r.by_distance[b].lo, lo[b]);
    EXPECT_EQ(r.by_distance[b].hi, hi[b]);
    EXPECT_EQ(r.by_distance[b].count, count[b]) << b;
    EXPECT_EQ(r.by_distance[b].correct, correct[b]) << b;
    EXPECT_DOUBLE_EQ(r.by_distance[b].loss_sum, loss[b]) << b;
  }
  EXPECT_DOUBLE_EQ(r.by_distance[1].accuracy(), 0.5);
  EXPECT_EQ(r.by_distance[2].accuracy(), 0.0);

  const std::vector<int64_t> too_few = {1, 2};
  EXPECT_FALSE(AccumulateEval(s, p, &too_few, &r).ok());
  const std::vector<int64_t> zero = {1, 0, 2, 3, 4};
  EXPECT_FALSE(AccumulateEval(s, p, &zero, &r).ok());
}

// The task's distances: the query's key paired with the label's value sits exactly that far back, and no other
// pair token of that key exists.
TEST(HeldOutRetrievalTest, DistancesPointAtTheKeysPairToken) {
  const RetrievalTask task = SmallTask(200);
  const EvalSet set = HeldOutRetrieval(task, 7, 4);
  ASSERT_EQ(set.sequences.size(), 4u);
  ASSERT_EQ(set.distances.size(), 4u);
  const int32_t first_value = RetrievalTask::kFirstKey + task.num_keys;
  const int32_t first_pair = first_value + task.num_values;
  for (size_t i = 0; i < set.sequences.size(); ++i) {
    const Sequence& s = set.sequences[i];
    size_t k = 0;
    for (size_t t = 0; t < s.ids.size(); ++t) {
      if (s.labels[t] < 0) continue;
      ASSERT_LT(k, set.distances[i].size());
      const int64_t d = set.distances[i][k++];
      ASSERT_GE(d, 1);
      ASSERT_GE(static_cast<int64_t>(t), d);
      const int32_t key = s.ids[t] - RetrievalTask::kFirstKey;
      const int32_t value = s.labels[t] - first_value;
      EXPECT_EQ(s.ids[t - d], first_pair + key * task.num_values + value) << "sequence " << i << " position " << t;
    }
    EXPECT_EQ(k, set.distances[i].size());
  }
  // Held out: none equals a training sequence of the same seed (training draws indices 0, 1, ...).
  std::set<std::vector<int32_t>> train;
  for (int64_t j = 0; j < 64; ++j) train.insert(task.Make(7, j).ids);
  for (const Sequence& s : set.sequences) EXPECT_EQ(train.count(s.ids), 0u);
  // Deterministic.
  EXPECT_EQ(HeldOutRetrieval(task, 7, 4).sequences[3].ids, set.sequences[3].ids);
}

TEST(EvaluateTest, BadInput) {
  auto model = Load("tiny");
  EXPECT_FALSE(Evaluate(*model, EvalSet{}, Chunked()).ok());
  Sequence unlabelled{{1, 2, 3}, {-100, -100, -100}};
  EXPECT_FALSE(Evaluate(*model, EvalSet{{unlabelled}, {}}, Chunked()).ok());
  Sequence outside{{1, 2, 300}, {1, 2, 3}};
  absl::StatusOr<EvalResult> r = Evaluate(*model, EvalSet{{outside}, {}}, Chunked());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("outside the vocabulary"), std::string::npos) << r.status();
}

// Window peaks restart on ResetWindow without touching the run's peak; the timeline records the current bytes
// per category after every allocation and release, and stops keeping events past its cap.
TEST(MemoryTrackerTest, WindowAndTimeline) {
  MemoryTracker mem;
  mem.Add(MemCategory::kWeights, 100);
  mem.Add(MemCategory::kActivations, 50);
  mem.Sub(MemCategory::kActivations, 50);
  mem.ResetWindow();
  MemorySnapshot s = mem.Snapshot();
  EXPECT_EQ(s.total_peak, 150);
  EXPECT_EQ(s.window_total_peak, 100);
  EXPECT_EQ(s.window_peak[static_cast<int>(MemCategory::kActivations)], 0);

  mem.StartTimeline();
  mem.Add(MemCategory::kKVCache, 30);
  mem.Add(MemCategory::kActivations, 20);
  mem.Sub(MemCategory::kKVCache, 30);
  int64_t dropped = -1;
  const std::vector<MemoryEvent> events = mem.StopTimeline(&dropped);
  EXPECT_EQ(dropped, 0);
  ASSERT_EQ(events.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(events[i].index, i);
  const int w = static_cast<int>(MemCategory::kWeights), kv = static_cast<int>(MemCategory::kKVCache),
            act = static_cast<int>(MemCategory::kActivations);
  EXPECT_EQ(events[0].current[w], 100);
  EXPECT_EQ(events[0].current[kv], 0);
  EXPECT_EQ(events[1].current[kv], 30);
  EXPECT_EQ(events[2].current[act], 20);
  EXPECT_EQ(events[3].current[kv], 0);
  s = mem.Snapshot();
  EXPECT_EQ(s.window_total_peak, 150);
  EXPECT_EQ(s.window_peak[kv], 30);
  EXPECT_EQ(s.total_peak, 150);

  mem.Add(MemCategory::kKVCache, 1);  // not recorded: the timeline is off
  mem.StartTimeline(/*max_events=*/2);
  for (int i = 0; i < 5; ++i) mem.Add(MemCategory::kLogits, 1);
  const std::vector<MemoryEvent> capped = mem.StopTimeline(&dropped);
  EXPECT_EQ(capped.size(), 2u);
  EXPECT_EQ(dropped, 4);
}

}  // namespace
}  // namespace sg
