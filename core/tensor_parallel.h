// Tensor parallelism (Megatron style) inside the layer primitives: each rank of a tensor-parallel group holds a
// block of every large weight and runs the same schedule on the same tokens; the strategies do not know.
//
// Transformers: q/k/v are split by rows in blocks of whole KV-head groups (rank r holds query heads
// [r H/tp, (r+1) H/tp) and KV heads [r G/tp, (r+1) G/tp), so GQA's head -> group map stays local), o_proj by
// columns; gate/up by rows, down by columns; the embedding and the LM head by vocabulary rows. One all-reduce per
// sub-layer in forward (after o_proj, after down_proj, after the embedding) and one in backward (the input gradient
// of each sub-layer's norm, and the head's); the cross-entropy is computed over the vocabulary shards with two
// all-reduces of per-row scalars per logits chunk, so no rank holds a full row of logits. Each rank's KV-cache and
// KV-gradient pages hold only its KV heads.
//
// Replicated parameters (norms, o_proj / down_proj biases) get identical gradients on every rank, except those
// marked partial_grad (Qwen3's q_norm / k_norm, which see only the rank's heads, and the LoRA matrices that meet a
// split dimension): those are summed over the group once per step (ReducePartialGrads).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/model_config.h"
#include "distributed/communicator.h"

namespace sg {

// One rank's place in its tensor-parallel group.
struct TensorParallel {
  int rank = 0;
  int size = 1;
  // The group's ranks; null with size > 1: shapes only, no communication (meta plans of one rank of a TP run).
  dist::Communicator* comm = nullptr;
  bool on() const { return size > 1; }
  // In place over the group (no-op without a communicator). Throws std::runtime_error on failure: the layer
  // primitives run inside the strategies' error capture (CatchStrategyErrors).
  void AllReduce(void* data, int64_t count, DType dtype, dist::ReduceOp op = dist::ReduceOp::kSum) const;
};

// How a parameter is split over the group: whole on every rank, or rank r holding block r of its first (rows) or
// second (cols) dimension.
enum class TpSplit { kReplicated, kRows, kCols };
struct TpShard {
  TpSplit split = TpSplit::kReplicated;
  bool partial_grad = false;  // replicated, but each rank's gradient is only its part of the sum
};

// Implemented by models that can be split (transformers so far; Mamba's d_inner split is planned).
class TensorParallelModel {
 public:
  virtual ~TensorParallelModel() = default;
  virtual const TensorParallel& tensor_parallel() const = 0;
  // The split of model.params()[i] (LoRA adapters included once enabled).
  virtual TpShard ShardOf(int param) const = 0;
};

// The model's tensor-parallel interface when it is split over more than one rank, else null.
const TensorParallelModel* TensorParallelOf(Model& model);

// Whether `config` splits over tp ranks: heads, KV heads, intermediate size and vocabulary divisible by tp.
// Errors give the numbers ("--tp=4: num_key_value_heads=2 is not divisible by 4 ..."). KV heads are never
// replicated: a KV head on two ranks would double its cache, which TP is there to split.
absl::Status ValidateTensorParallel(const TransformerConfig& config, int tp);

// Sums the partial_grad parameters' gradients over the group (no-op for an unsplit model).
absl::Status ReducePartialGrads(Model& model);

// The squared global gradient norm of a split model: split gradients summed over the group, replicated ones
// counted once. A non-finite gradient on any rank fails on every rank (this rank's names the parameter).
absl::StatusOr<double> TensorParallelGradSquaredNorm(Model& model, const std::string& when);

// Between a split model and a whole one of the same configuration (same parameter names and order; LoRA on both
// or neither), e.g. to start from a checkpoint or to save one. Values only (gradients are not copied).
// Every rank takes its blocks of `whole`'s values (no communication).
absl::Status ScatterParams(Model& whole, Model& split);
// Every rank of the group assembles `whole` from the ranks' blocks (collective: all ranks call it).
absl::Status GatherParams(Model& split, Model& whole);
// The same for the gradients (of the parameters that have one on both sides).
absl::Status GatherGrads(Model& split, Model& whole);
// The same for one tensor of parameter `param` (optimizer moments and masters have their parameter's shape).
absl::Status SliceTensor(const Tensor& whole, TpShard shard, const TensorParallel& tp, Tensor& block);
absl::Status GatherTensor(const Tensor& block, TpShard shard, const TensorParallel& tp, Tensor& whole);

}  // namespace sg
