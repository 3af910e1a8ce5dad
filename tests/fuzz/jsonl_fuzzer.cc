// libFuzzer entry point: bazel build --config=fuzz //tests:jsonl_fuzzer (clang), then run it on
// tests/fuzz/corpus/jsonl.
#include "tests/fuzz/targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return sg::fuzz::FuzzJsonl(data, size); }
