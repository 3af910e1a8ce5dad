// libFuzzer entry point: bazel build --config=fuzz //tests:safetensors_fuzzer (clang), then run it on
// tests/fuzz/corpus/safetensors.
#include "tests/fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return sg::fuzz::FuzzSafetensors(data, size);
}
