// sg_trainer_set_reference_base_model through the C ABI: dpo with the trainer's model without its LoRA adapters as
// the reference gives every digit of dpo with a separately created copy of the base model as sg_trainer_set_reference,
// step after step; without LoRA, or on a NULL trainer, the call is refused and says why.
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

sg_model* Tiny(bool lora) {
  sg_model* m = nullptr;
  EXPECT_EQ(Code(sg_model_create_preset("tiny", "f64", 7, &m)), 0);
  if (lora) {
    sg_lora_options o = sg_lora_default_options();
    o.rank = 4;
    o.targets = "all";
    EXPECT_EQ(Code(sg_model_enable_lora(m, &o)), 0);
  }
  return m;
}

sg_trainer* DpoTrainer(sg_model* m) {
  sg_trainer_options o = sg_trainer_default_options();
  o.objective = "dpo";
  o.strategy = "seco";
  o.chunk = 4;
  o.lr = 0.05;
  sg_trainer* t = nullptr;
  EXPECT_EQ(Code(sg_trainer_create(m, &o, &t)), 0);
  return t;
}

double DpoStep(sg_trainer* t) {
  const std::vector<int32_t> a = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38}, b = {2, 71, 82, 81, 82, 84, 59, 4, 5};
  const std::vector<int32_t> la = {-100, -100, -100, 92, 65, 35, 89, 79, 32, 38},
                             lb = {-100, -100, -100, 81, 82, 84, 59, 4, 5};
  const int32_t* chosen[] = {a.data()};
  const int32_t* chosen_labels[] = {la.data()};
  const int32_t* rejected[] = {b.data()};
  const int32_t* rejected_labels[] = {lb.data()};
  const int64_t chosen_len[] = {static_cast<int64_t>(a.size())}, rejected_len[] = {static_cast<int64_t>(b.size())};
  sg_metrics m = sg_metrics_init();
  std::string message;
  EXPECT_EQ(Code(sg_trainer_step_dpo(t, chosen, chosen_labels, chosen_len, rejected, rejected_labels, rejected_len,
                                     nullptr, nullptr, 1, &m),
                 &message),
            0)
      << message;
  return m.loss;
}

TEST(ReferenceBaseModelTest, EqualsASeparateBaseModel) {
  sg_model *one = Tiny(true), *two = Tiny(true), *base = Tiny(false);
  sg_trainer *with_base = DpoTrainer(one), *with_model = DpoTrainer(two);
  ASSERT_EQ(Code(sg_trainer_set_reference_base_model(with_base)), 0);
  ASSERT_EQ(Code(sg_trainer_set_reference(with_model, base)), 0);
  for (int step = 0; step < 3; ++step) {
    const double a = DpoStep(with_base), b = DpoStep(with_model);
    EXPECT_EQ(a, b) << "step " << step;
    // B starts at zero: the policy is the reference (log 2) until the first update moves the adapters.
    if (step == 0) {
      EXPECT_NEAR(a, std::log(2.0), 1e-15);
    } else {
      EXPECT_GT(std::abs(a - std::log(2.0)), 1e-4);
    }
  }
  sg_trainer_free(with_base);
  sg_trainer_free(with_model);
  sg_model_free(one);
  sg_model_free(two);
  sg_model_free(base);
}

TEST(ReferenceBaseModelTest, RefusedWithoutLoraOrTrainer) {
  std::string message;
  EXPECT_EQ(Code(sg_trainer_set_reference_base_model(nullptr), &message), SG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(message.find("trainer"), std::string::npos) << message;
  sg_model* plain = Tiny(false);
  sg_trainer* t = DpoTrainer(plain);
  EXPECT_EQ(Code(sg_trainer_set_reference_base_model(t), &message), SG_ERR_FAILED_PRECONDITION);
  EXPECT_NE(message.find("sg_trainer_set_reference_base_model: the trainer's model has no LoRA adapters"),
            std::string::npos)
      << message;
  sg_trainer_free(t);
  sg_model_free(plain);
}

}  // namespace
