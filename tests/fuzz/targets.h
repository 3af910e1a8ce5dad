// Fuzz targets for the readers of untrusted files: config.json, safetensors, the shard index and JSONL data. Each
// takes one input and must return without a crash, a leak, undefined behaviour or a hang, whatever the bytes; any
// result (a model config, an error) is fine. libFuzzer entry points are <name>_fuzzer.cc; fuzz_io_test.cc replays
// the checked-in corpus and mutates it for a bounded time under the project's own compiler (ASan in CI).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sg::fuzz {

int FuzzConfig(const uint8_t* data, size_t size);
int FuzzSafetensors(const uint8_t* data, size_t size);
int FuzzIndex(const uint8_t* data, size_t size);
int FuzzJsonl(const uint8_t* data, size_t size);

struct Target {
  const char* name;  // also the corpus directory: tests/fuzz/corpus/<name>
  int (*run)(const uint8_t* data, size_t size);
};
inline constexpr Target kTargets[] = {
    {"config", FuzzConfig}, {"safetensors", FuzzSafetensors}, {"index", FuzzIndex}, {"jsonl", FuzzJsonl}};

}  // namespace sg::fuzz
