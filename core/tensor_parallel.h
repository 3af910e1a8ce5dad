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
// Mamba: the d_inner channels are split. in_proj by rows (each rank its block of the x channels and of the z
// channels), the conv, A_log, D and dt_proj (rows, bias) by channel, x_proj and out_proj by columns; the scan and its
// carried state (h, conv tail) are per channel and stay local. Two all-reduces each way per layer: forward x_proj's
// (dt, B, C) and out_proj's output, backward the gradient of x_proj's output (d(dt), dB, dC: every rank's channels
// gave part of it) and in_proj's input gradient. Embedding and LM head as the transformer's.
//
// Replicated parameters (norms, o_proj / down_proj biases) get identical gradients on every rank, except those
// marked partial_grad (Qwen3's q_norm / k_norm, which see only the rank's heads, and the LoRA matrices that meet a
// split dimension): those are summed over the group once per step (ReducePartialGrads).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/communicator.h"
#include "core/lora.h"
#include "core/model.h"
#include "core/models/mamba/config.h"
#include "core/models/transformer/config.h"

namespace sg {

// One rank's place in its tensor-parallel group.
struct TensorParallel {
  int rank = 0;
  int size = 1;
  // The group's ranks; null with size > 1: shapes only, no communication (meta plans of one rank of a TP run).
  dist::Communicator* comm = nullptr;
  // Where the layers' tensors live (CreateModelLike sets the model's device).
  Device device = Device::kCPU;
  bool on() const { return size > 1; }
  // In place over the group (no-op without a communicator), data in `device`'s memory: a communicator that takes
  // device memory (NCCL's, Communicator::device_memory) gets it after the device's earlier work; any other
  // (MPI: Debian's OpenMPI is not CUDA-aware) a host copy. Throws std::runtime_error on failure: the layer
  // primitives run inside the strategies' error capture (CatchStrategyErrors).
  void AllReduce(void* data, int64_t count, DType dtype, dist::ReduceOp op = dist::ReduceOp::kSum) const;
  // The same for host arrays (per-row scalars, page scores).
  void AllReduceHost(void* data, int64_t count, DType dtype, dist::ReduceOp op = dist::ReduceOp::kSum) const;
};

// How a parameter is split over the group: whole on every rank, or rank r holding block r of its first (rows) or
// second (cols) dimension.
enum class TpSplit { kReplicated, kRows, kCols };
struct TpShard {
  TpSplit split = TpSplit::kReplicated;
  bool partial_grad = false;  // replicated, but each rank's gradient is only its part of the sum
  // kRows: the first dimension stacks `parts` equal matrices, each split by rows (Mamba's in_proj: x, then z).
  int parts = 1;
};

// Implemented by models that can be split (transformers and Mamba).
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
// Mamba: intermediate_size (d_inner) and vocabulary divisible by tp.
absl::Status ValidateTensorParallel(const MambaConfig& config, int tp);
// tp.rank inside the group, and tp.device the model's device (when it communicates).
absl::Status CheckTensorParallelPlacement(const TensorParallel& tp, Device device);

// The split of a LoRA parameter follows its weight's (shards: per base parameter): a column-parallel weight's B is
// split as the weight and its A sees the whole input (partial gradient); a row-parallel weight's A is split by
// columns and its B's gradient is partial. Base parameters: shards[param].
TpShard ShardOfParam(const std::vector<TpShard>& shards, const LoraInfo* lora, int param);
// Per adapter, the whole input's column of its first input column (ParamStore::lora_col0_): rank * in for a
// row-parallel weight, whose input is split, else 0.
std::vector<int64_t> LoraFirstColumns(const std::vector<TpShard>& shards, const LoraInfo& lora, int rank);

// A zero-initialised model of `like`'s family, configuration, created dtype and LoRA options on `device`, split
// over tp (whole for tp.size 1).
absl::StatusOr<std::unique_ptr<Model>> CreateModelLike(Model& like, Device device, const TensorParallel& tp);

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
