// The C ABI's device paths against the CPU emulation of the CUDA backend (linked in: no GPU needed): models
// created and loaded on "cuda", their parameters and gradients reached only through sg_model_read_param /
// sg_model_write_param (the emulated device memory faults on any host access), a training step, save and load,
// and the errors of bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "seqgrad/seqgrad.h"

namespace {

std::string Take(sg_status* s) {
  if (!s) return "";
  std::string m = std::to_string(sg_status_code(s)) + ": " + sg_status_message(s);
  sg_status_free(s);
  return m;
}
#define ASSERT_SG_OK(call) ASSERT_EQ(Take(call), "")

sg_model* Create(const char* device, const char* dtype) {
  sg_model_options o = sg_model_default_options();
  o.device = device;
  o.dtype = dtype;
  o.seed = 3;
  sg_model* m = nullptr;
  EXPECT_EQ(Take(sg_model_create_preset_with("tiny", &o, &m)), "");
  return m;
}

// Parameter i's values (which = SG_PARAM_VALUE) or gradient as doubles (an f64 model).
std::vector<double> Read(const sg_model* m, int64_t i, int which) {
  sg_param_info p = sg_param_info_init();
  EXPECT_EQ(Take(sg_model_param_info(m, i, &p)), "");
  std::vector<double> v(p.numel);
  EXPECT_EQ(Take(sg_model_read_param(m, i, which, v.data(), v.size() * sizeof(double))), "");
  return v;
}

std::vector<int32_t> Ids() {
  std::vector<int32_t> ids(19);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 5) % 97);
  return ids;
}

TEST(CabiCudaEmulated, ModelsOnTheDeviceMatchTheCpu) {
  sg_model* gpu = Create("cuda", "f64");
  sg_model* cpu = Create(nullptr, "f64");
  ASSERT_TRUE(gpu && cpu);
  EXPECT_STREQ(sg_model_device(gpu), "cuda");
  EXPECT_STREQ(sg_model_device(cpu), "cpu");
  sg_param_info info = sg_param_info_init();
  ASSERT_SG_OK(sg_model_param_info(gpu, 0, &info));
  EXPECT_NE(info.on_device, 0);
  ASSERT_SG_OK(sg_model_param_info(cpu, 0, &info));
  EXPECT_EQ(info.on_device, 0);
  const int64_t n = sg_model_num_params(gpu);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(Read(gpu, i, SG_PARAM_VALUE), Read(cpu, i, SG_PARAM_VALUE)) << i;

  // One chunked step's gradients, on both.
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = "seco";
  o.chunk = 5;
  o.page_size = 4;
  const std::vector<int32_t> ids = Ids();
  const int64_t len = static_cast<int64_t>(ids.size());
  for (sg_model* m : {gpu, cpu}) {
    sg_trainer* t = nullptr;
    ASSERT_SG_OK(sg_trainer_create(m, &o, &t));
    ASSERT_SG_OK(sg_trainer_compute_gradients(t, ids.data(), nullptr, len, &len, 1, nullptr));
    sg_trainer_free(t);
  }
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<double> g = Read(gpu, i, SG_PARAM_GRAD), c = Read(cpu, i, SG_PARAM_GRAD);
    ASSERT_EQ(g.size(), c.size());
    double diff = 0, norm = 0;
    for (size_t k = 0; k < g.size(); ++k) diff += (g[k] - c[k]) * (g[k] - c[k]), norm += c[k] * c[k];
    EXPECT_LE(std::sqrt(diff), 1e-10 * std::sqrt(norm) + 1e-300) << "gradient " << i;
  }

  // Writes reach the device; save and load on the device keep them.
  std::vector<double> w = Read(gpu, 1, SG_PARAM_VALUE);
  for (double& x : w) x = x * 0.5 + 0.25;
  ASSERT_SG_OK(sg_model_write_param(gpu, 1, SG_PARAM_VALUE, w.data(), w.size() * sizeof(double)));
  EXPECT_EQ(Read(gpu, 1, SG_PARAM_VALUE), w);
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/saved";
  ASSERT_SG_OK(sg_model_save(gpu, dir.c_str()));
  sg_model_options lo = sg_model_default_options();
  lo.device = "cuda";
  lo.dtype = "f64";
  sg_model* loaded = nullptr;
  ASSERT_SG_OK(sg_model_load_with(dir.c_str(), &lo, &loaded));
  EXPECT_STREQ(sg_model_device(loaded), "cuda");
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(Read(loaded, i, SG_PARAM_VALUE), Read(gpu, i, SG_PARAM_VALUE)) << i;
  sg_model_free(loaded);
  sg_model_free(gpu);
  sg_model_free(cpu);
}

// A Mamba preset's initialisation (A_log, dt_proj, ...) reaches the device as on the CPU.
TEST(CabiCudaEmulated, SsmPresetOnTheDevice) {
  sg_model_options o = sg_model_default_options();
  o.dtype = "f64";
  o.seed = 4;
  sg_model* cpu = nullptr;
  ASSERT_SG_OK(sg_model_create_preset_with("tiny-ssm", &o, &cpu));
  o.device = "cuda";
  sg_model* gpu = nullptr;
  ASSERT_SG_OK(sg_model_create_preset_with("tiny-ssm", &o, &gpu));
  for (int64_t i = 0; i < sg_model_num_params(cpu); ++i)
    EXPECT_EQ(Read(gpu, i, SG_PARAM_VALUE), Read(cpu, i, SG_PARAM_VALUE)) << i;
  sg_model_free(gpu);
  sg_model_free(cpu);
}

TEST(CabiCudaEmulated, BadArgumentsAreNamed) {
  sg_model_options o = sg_model_default_options();
  o.device = "tpu";
  sg_model* m = nullptr;
  const std::string bad_device = Take(sg_model_create_preset_with("tiny", &o, &m));
  EXPECT_NE(bad_device.find("options->device is 'tpu'"), std::string::npos) << bad_device;
  EXPECT_EQ(m, nullptr);
  o = sg_model_default_options();
  o.struct_size = 4;
  EXPECT_NE(Take(sg_model_load_with("/nonexistent", &o, &m)).find("options->struct_size"), std::string::npos);

  m = Create("cuda", "f32");
  ASSERT_NE(m, nullptr);
  float x[4];
  const std::string wrong_size = Take(sg_model_read_param(m, 0, SG_PARAM_VALUE, x, sizeof x));
  EXPECT_EQ(wrong_size.rfind(std::to_string(SG_ERR_INVALID_ARGUMENT) + ":", 0), 0u) << wrong_size;
  EXPECT_NE(wrong_size.find("'bytes'"), std::string::npos) << wrong_size;
  EXPECT_NE(Take(sg_model_read_param(m, 0, 7, x, sizeof x)).find("'which'"), std::string::npos);
  EXPECT_NE(Take(sg_model_read_param(m, 9999, SG_PARAM_VALUE, x, sizeof x)).find("'index'"), std::string::npos);
  sg_model_free(m);
}

}  // namespace
