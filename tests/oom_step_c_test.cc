// Out of memory inside a step, through the C ABI: with the address space capped (RLIMIT_AS) a step that needs more
// fails with SG_ERR_RESOURCE_EXHAUSTED naming the bytes, and the model and trainer stay usable. Not under ASan,
// whose shadow memory does not live within an address-space limit.
#include <sys/resource.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "seqgrad/seqgrad.h"
#include "tests/bad_input_support.h"

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAsan = true;
#else
constexpr bool kUnderAsan = false;
#endif

// VmSize of this process in bytes.
int64_t AddressSpace() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key)
    if (key == "VmSize:") {
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
  return 0;
}

std::string Step(sg_trainer* trainer, int64_t n) {
  std::vector<int32_t> ids(n), labels(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = labels[i] = 1 + static_cast<int32_t>(i % 90);
  const int64_t lengths[1] = {n};
  sg_metrics m = sg_metrics_init();
  sg_status* s = sg_trainer_step(trainer, ids.data(), labels.data(), n, lengths, 1, &m);
  if (!s) return "OK";
  std::string out = std::string(sg_code_name(sg_status_code(s))) + ": " + sg_status_message(s);
  sg_status_free(s);
  return out;
}

TEST(OomInStep, IsResourceExhaustedWithTheBytes) {
  if (kUnderAsan) GTEST_SKIP() << "RLIMIT_AS does not apply under ASan";
  sg_model* model = nullptr;
  ASSERT_EQ(sg_model_create_preset("tiny", "f32", 0, &model), nullptr);
  sg_trainer_options options = sg_trainer_default_options();
  sg_trainer* trainer = nullptr;
  ASSERT_EQ(sg_trainer_create(model, &options, &trainer), nullptr);
  ASSERT_EQ(Step(trainer, 64), "OK");  // threads, BLAS buffers and optimizer moments exist from here on

  struct rlimit old_limit;
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old_limit), 0);
  struct rlimit capped = old_limit;
  capped.rlim_cur = static_cast<rlim_t>(AddressSpace() + (256 << 20));
  ASSERT_EQ(setrlimit(RLIMIT_AS, &capped), 0);
  const std::string big = Step(trainer, 2000000);  // gigabytes of activations under full backprop
  ASSERT_EQ(setrlimit(RLIMIT_AS, &old_limit), 0);
  // e.g. "RESOURCE_EXHAUSTED: step 2 (strategy 'full'): out of memory: the allocator refused 128008192 bytes of
  // kv_grad asked on the host, 23721852928 bytes available"
  EXPECT_EQ(big.rfind("RESOURCE_EXHAUSTED: ", 0), 0) << big;
  EXPECT_NE(big.find("out of memory"), std::string::npos) << big;
  EXPECT_NE(big.find(" bytes available"), std::string::npos) << big;
  EXPECT_EQ(Step(trainer, 64), "OK");  // still usable
  sg_trainer_free(trainer);
  sg_model_free(model);
}

}  // namespace
