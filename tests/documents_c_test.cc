// Packed documents through the C ABI (sg_batch's num_documents / doc_lengths): a batch of one sequence packing three
// documents gives the loss, the gradients and the per-token log-probs of the documents as three sequences (f64, a
// chunked strategy that cuts documents); bad document lengths are refused naming the argument.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "seqgrad/seqgrad.h"

namespace {

// The status's code (0 = success), freeing it; its message into *message.
int Code(sg_status* s, std::string* message = nullptr) {
  if (!s) return 0;
  const int code = sg_status_code(s);
  if (message) *message = sg_status_message(s);
  sg_status_free(s);
  return code;
}

struct Tiny {
  sg_model* model = nullptr;
  sg_trainer* trainer = nullptr;
  Tiny() {
    EXPECT_EQ(Code(sg_model_create_preset("tiny", "f64", 7, &model)), 0);
    sg_trainer_options o = sg_trainer_default_options();
    o.strategy = "seco";
    o.chunk = 4;
    o.page_size = 2;
    EXPECT_EQ(Code(sg_trainer_create(model, &o, &trainer)), 0);
  }
  ~Tiny() {
    sg_trainer_free(trainer);
    sg_model_free(model);
  }
  std::vector<double> Grads() const {
    std::vector<double> all;
    for (int64_t i = 0; i < sg_model_num_params(model); ++i) {
      sg_param_info p = sg_param_info_init();
      EXPECT_EQ(Code(sg_model_param_info(model, i, &p)), 0);
      const double* g = static_cast<const double*>(p.grad);
      all.insert(all.end(), g, g + p.numel);
    }
    return all;
  }
};

const std::vector<int32_t> kTokens = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 83};
const int64_t kDocs[] = {5, 3, 6};

sg_batch Packed(const int64_t* num_documents, const int64_t* doc_lengths) {
  static const int64_t length[] = {static_cast<int64_t>(kTokens.size())};
  sg_batch b = sg_batch_init();
  b.ids = kTokens.data();
  b.num_tokens = length[0];
  b.lengths = length;
  b.num_sequences = 1;
  b.num_documents = num_documents;
  b.doc_lengths = doc_lengths;
  return b;
}

TEST(DocumentsC, PackedEqualsTheDocumentsAsSequences) {
  const int64_t count[] = {3};
  Tiny packed, alone;
  const sg_batch b = Packed(count, kDocs);
  sg_metrics mp = sg_metrics_init(), ma = sg_metrics_init();
  std::string message;
  ASSERT_EQ(Code(sg_trainer_compute_gradients_batch(packed.trainer, &b, &mp), &message), 0) << message;
  ASSERT_EQ(Code(sg_trainer_compute_gradients(alone.trainer, kTokens.data(), nullptr, b.num_tokens, kDocs, 3, &ma)), 0);
  EXPECT_EQ(mp.tokens, 11);  // 13 positions less the 2 whose label is the next document's first token
  EXPECT_EQ(mp.tokens, ma.tokens);
  EXPECT_NEAR(mp.loss, ma.loss, 1e-13 * ma.loss);
  const std::vector<double> gp = packed.Grads(), ga = alone.Grads();
  ASSERT_EQ(gp.size(), ga.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ga.size(); ++i) {
    diff = std::max(diff, std::abs(gp[i] - ga[i]));
    scale = std::max(scale, std::abs(ga[i]));
  }
  EXPECT_GT(scale, 0);
  EXPECT_LE(diff, 1e-11 * scale);

  std::vector<double> lp(kTokens.size()), la(kTokens.size());
  ASSERT_EQ(Code(sg_trainer_score_batch(packed.trainer, &b, lp.data(), nullptr)), 0);
  ASSERT_EQ(Code(sg_trainer_score(alone.trainer, kTokens.data(), nullptr, b.num_tokens, kDocs, 3, la.data(), nullptr)),
            0);
  for (size_t t = 0; t < la.size(); ++t) {
    EXPECT_EQ(std::isnan(lp[t]), std::isnan(la[t])) << t;
    if (!std::isnan(la[t])) {
      EXPECT_NEAR(lp[t], la[t], 1e-12 * std::abs(la[t])) << t;
    }
  }
  sg_eval_result ep = sg_eval_result_init(), ea = sg_eval_result_init();
  ASSERT_EQ(Code(sg_trainer_evaluate_detailed_batch(packed.trainer, &b, nullptr, &ep)), 0);
  ASSERT_EQ(
      Code(sg_trainer_evaluate_detailed(alone.trainer, kTokens.data(), nullptr, b.num_tokens, kDocs, 3, nullptr, &ea)),
      0);
  EXPECT_EQ(ep.tokens, ea.tokens);
  EXPECT_NEAR(ep.loss, ea.loss, 1e-13 * ea.loss);

  // Without documents (NULL counts, or a count of 1) the packed sequence attends across: another loss.
  sg_metrics m1 = sg_metrics_init(), m0 = sg_metrics_init();
  const int64_t one[] = {1}, whole[] = {14};
  const sg_batch single = Packed(one, whole), none = Packed(nullptr, nullptr);
  ASSERT_EQ(Code(sg_trainer_evaluate_batch(packed.trainer, &single, &m1)), 0);
  ASSERT_EQ(Code(sg_trainer_evaluate_batch(packed.trainer, &none, &m0)), 0);
  EXPECT_EQ(m1.tokens, 13);
  EXPECT_EQ(m1.loss, m0.loss);
  EXPECT_GT(std::abs(m1.loss - mp.loss), 1e-6);
}

TEST(DocumentsC, BadDocumentsAreRefusedByName) {
  Tiny t;
  const struct {
    std::vector<int64_t> count, lengths;
    std::string error;
  } cases[] = {
      {{3}, {5, 0, 9}, "sg_trainer_step_batch: doc_lengths[0][1] = 0; sequence 0's documents need >= 1 token each"},
      {{2}, {5, 10}, "doc_lengths[0][1] = 10"},
      {{2}, {5, 8}, "doc_lengths[0] sums to 13 but lengths[0] is 14"},
      {{-1}, {}, "num_documents[0] = -1"},
      {{15}, {}, "num_documents[0] = 15; need 0 to lengths[0] = 14 documents"},
      {{2}, {}, "argument 'doc_lengths' is NULL"},
  };
  for (const auto& c : cases) {
    const sg_batch b = Packed(c.count.data(), c.lengths.empty() ? nullptr : c.lengths.data());
    std::string message;
    EXPECT_EQ(Code(sg_trainer_step_batch(t.trainer, &b, nullptr), &message), SG_ERR_INVALID_ARGUMENT) << c.error;
    EXPECT_NE(message.find(c.error), std::string::npos) << message;
  }
  EXPECT_EQ(sg_trainer_step_count(t.trainer), 0);
  std::string message;
  EXPECT_EQ(Code(sg_trainer_step_batch(t.trainer, nullptr, nullptr), &message), SG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(message.find("argument 'batch' is NULL"), std::string::npos) << message;
  sg_batch small = Packed(nullptr, nullptr);
  small.struct_size = sizeof(size_t);
  EXPECT_EQ(Code(sg_trainer_step_batch(t.trainer, &small, nullptr), &message), SG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(message.find("batch->struct_size is 8"), std::string::npos) << message;
  // A newer caller's larger struct: the fields this library knows are read.
  struct {
    sg_batch b;
    int64_t newer_field;
  } larger = {Packed(nullptr, nullptr), 1};
  larger.b.struct_size = sizeof(larger);
  EXPECT_EQ(Code(sg_trainer_step_batch(t.trainer, &larger.b, nullptr), &message), 0) << message;
}

}  // namespace
