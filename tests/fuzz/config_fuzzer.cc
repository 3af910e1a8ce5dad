// libFuzzer entry point: bazel build --config=fuzz //tests:config_fuzzer (clang), then run it on
// tests/fuzz/corpus/config.
#include "tests/fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return sg::fuzz::FuzzConfig(data, size); }
