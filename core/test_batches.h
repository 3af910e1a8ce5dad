// Test helper: a small ragged batch (lengths 23 and 9) of pseudo-random tokens with some labels ignored.
#pragma once

#include <cstdint>
#include <vector>

#include "core/strategy.h"

namespace sg {

inline std::vector<Sequence> RaggedBatch(int64_t vocab, uint64_t seed) {
  std::vector<Sequence> batch;
  uint64_t x = seed;
  for (int64_t len : {23, 9}) {
    Sequence s;
    for (int64_t i = 0; i < len; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      s.ids.push_back(static_cast<int32_t>((x >> 33) % vocab));
      s.labels.push_back(i % 5 == 3 ? -100 : static_cast<int32_t>((x >> 17) % vocab));
    }
    batch.push_back(s);
  }
  return batch;
}

}  // namespace sg
