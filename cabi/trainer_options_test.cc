// sg_trainer_default_options (cabi/trainer_options.inc's defaults) gives the engine's defaults: the options an older
// caller's struct lacks take the engine structs' defaults, so the two must agree.
#include "cabi/trainer_options.h"

#include <string>
#include <type_traits>

#include "core/objective.h"
#include "core/optimizer.h"
#include "core/strategy.h"
#include "gtest/gtest.h"

namespace sg::cabi {
namespace {

struct ByHand;  // the options cabi/trainer.cc converts itself, checked one by one below

template <typename Engine>
void ExpectEngineDefaults(const Engine& e) {
  const sg_trainer_options o = sg_trainer_default_options();
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc)                         \
  if constexpr (std::is_same_v<Engine, engine>) {                                    \
    EXPECT_EQ(e.name, static_cast<std::decay_t<decltype(e.name)>>(o.name)) << #name; \
  }
#include "cabi/trainer_options.inc"
}

TEST(TrainerOptionsTest, DefaultsAreTheEngines) {
  ExpectEngineDefaults(StrategyOptions());
  ExpectEngineDefaults(OptimizerOptions());
  ExpectEngineDefaults(ObjectiveOptions());
  const sg_trainer_options o = sg_trainer_default_options();
  EXPECT_EQ(o.struct_size, sizeof(sg_trainer_options));
  EXPECT_EQ(StrategyOptions().name, o.strategy);
  EXPECT_EQ(ObjectiveOptions().name, o.objective);
  EXPECT_EQ(ObjectiveOptions().grpo_kl_bias_correction, o.grpo_kl_bias_correction != 0);
  EXPECT_EQ(o.num_threads, 0);
  EXPECT_EQ(o.tp, 0);
  for (uint64_t r : o.reserved) EXPECT_EQ(r, 0u);
}

}  // namespace
}  // namespace sg::cabi
