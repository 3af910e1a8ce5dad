// The CPU entries of ops.inc's tensor-parallel block (a vocabulary split over a group of ranks).
#pragma once

#include "kernels/backend.h"

namespace sg::cpu {

// Sets t's embedding_shard_* and vocab_shard_* entries (the _bf16 ones in the f32 table).
template <typename T>
void AddVocabParallelOps(OpTable<T>& t);

}  // namespace sg::cpu
