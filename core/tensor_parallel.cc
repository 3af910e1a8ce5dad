#include "core/tensor_parallel.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/models/family.h"
#include "core/optimizer.h"
#include "kernels/backend.h"

namespace sg {

void TensorParallel::AllReduceHost(void* data, int64_t count, DType dtype, dist::ReduceOp op) const {
  if (!comm || size <= 1) return;
  if (absl::Status s = comm->AllReduce(data, count, dtype, op); !s.ok())
    throw std::runtime_error(absl::StrCat("tensor parallel all-reduce: ", s.message()));
}

void TensorParallel::AllReduce(void* data, int64_t count, DType dtype, dist::ReduceOp op) const {
  if (!comm || size <= 1 || HostAddressable(device)) return AllReduceHost(data, count, dtype, op);
  if (dist::Communicator* on_device = comm->device_memory()) {
    SynchronizeDevice(device);  // the communicator runs on its own stream
    if (absl::Status s = on_device->AllReduce(data, count, dtype, op); !s.ok())
      throw std::runtime_error(absl::StrCat("tensor parallel all-reduce: ", s.message()));
    return;
  }
  const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
  std::vector<char> host(bytes);
  CopyToHost(device, host.data(), data, bytes);
  AllReduceHost(host.data(), count, dtype, op);
  CopyFromHost(device, data, host.data(), bytes);
}

const TensorParallelModel* TensorParallelOf(Model& model) {
  const auto* m = dynamic_cast<const TensorParallelModel*>(&model);
  return m && m->tensor_parallel().on() ? m : nullptr;
}

namespace {
absl::Status Divisible(int tp, std::initializer_list<std::pair<const char*, int64_t>> fields) {
  for (auto [field, v] : fields) {
    if (v % tp != 0)
      return absl::InvalidArgumentError(
          absl::StrCat("--tp=", tp, ": ", field, "=", v, " is not divisible by ", tp, " (", v % tp, " left over)"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status ValidateTensorParallel(const TransformerConfig& c, int tp) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp must be at least 1, got ", tp));
  if (c.num_kv_heads > 0 && c.num_kv_heads < tp)
    return absl::InvalidArgumentError(absl::StrCat(
        "--tp=", tp, " exceeds num_key_value_heads=", c.num_kv_heads,
        ": every rank needs a KV head of its own (KV heads are not replicated, which would keep the KV cache from "
        "shrinking with tp); use --tp <= ",
        c.num_kv_heads, " and combine with data parallelism"));
  return Divisible(tp, {{"num_attention_heads", c.num_heads},
                        {"num_key_value_heads", c.num_kv_heads},
                        {"intermediate_size", c.intermediate_size},
                        {"vocab_size", c.vocab_size}});
}

absl::Status ValidateTensorParallel(const MambaConfig& c, int tp) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp must be at least 1, got ", tp));
  return Divisible(tp, {{"intermediate_size", c.intermediate_size}, {"vocab_size", c.vocab_size}});
}

absl::Status CheckTensorParallelPlacement(const TensorParallel& tp, Device device) {
  if (tp.rank < 0 || tp.rank >= tp.size)
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel rank ", tp.rank, " is outside [0, ", tp.size, ")"));
  if (tp.comm && tp.size > 1 && tp.device != device)
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel: the group's buffers are on ",
                                                   DeviceName(tp.device), " but the model is on ", DeviceName(device),
                                                   " (split models with SplitModel / CreateModelLike)"));
  return absl::OkStatus();
}

TpShard ShardOfParam(const std::vector<TpShard>& shards, const LoraInfo* lora, int param) {
  if (param < static_cast<int>(shards.size())) return shards[param];
  const LoraAdapter* ad = lora ? lora->AdapterOfParam(param) : nullptr;
  if (!ad) return {};
  const TpShard weight = shards[ad->weight];
  const TpShard partial{TpSplit::kReplicated, true};
  if (weight.split == TpSplit::kRows) return param == ad->a ? partial : weight;
  if (weight.split == TpSplit::kCols) return param == ad->a ? TpShard{TpSplit::kCols} : partial;
  return {};
}

std::vector<int64_t> LoraFirstColumns(const std::vector<TpShard>& shards, const LoraInfo& lora, int rank) {
  std::vector<int64_t> cols;
  for (const LoraAdapter& ad : lora.adapters)
    cols.push_back(shards[ad.weight].split == TpSplit::kCols ? rank * ad.in : 0);
  return cols;
}

absl::StatusOr<std::unique_ptr<Model>> CreateModelLike(Model& like, Device device, const TensorParallel& group) {
  TensorParallel tp = group;
  tp.device = device;
  absl::StatusOr<std::unique_ptr<Model>> m =
      like.spec()->Create(CreatedDType(like), device, tp, /*frozen_base=*/like.lora() != nullptr);
  if (!m.ok()) return m.status();
  if (like.lora())
    if (absl::Status s = EnableLora(**m, like.lora()->options); !s.ok()) return s;
  return m;
}

namespace {

template <typename T>
double SumSquares(const Tensor& t) {
  std::vector<T> copy;
  const T* p = HostReadable(t.device(), t.data<T>(), t.numel(), &copy);
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(p[i]) * static_cast<double>(p[i]);
  return s;
}

// A tensor's bytes as rows, each of which the split cuts into tp equal blocks: for kCols the first dimension's rows;
// for kRows the `parts` stacked matrices (one row each).
struct Layout {
  int64_t rows = 1, row_bytes = 0;
};
Layout LayoutOf(const Tensor& t, TpShard shard) {
  Layout l;
  l.rows = shard.split == TpSplit::kRows ? shard.parts : t.shape().empty() ? 1 : t.dim(0);
  l.row_bytes = l.rows > 0 ? static_cast<int64_t>(t.nbytes()) / l.rows : 0;
  return l;
}

absl::Status CheckBlock(const Tensor& whole, TpShard shard, int tp, const Tensor& block) {
  std::vector<int64_t> expect = whole.shape();
  const bool rows_split = shard.split == TpSplit::kRows && !expect.empty() && expect[0] % (shard.parts * tp) == 0;
  if (rows_split) expect[0] /= tp;
  if (shard.split == TpSplit::kCols && expect.size() == 2) expect[1] /= tp;
  if (block.shape() != expect || block.dtype() != whole.dtype() || (shard.split == TpSplit::kRows && !rows_split))
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor parallel: a block of shape [", absl::StrJoin(block.shape(), ", "),
        "] does not belong to a tensor of shape [", absl::StrJoin(whole.shape(), ", "), "] split over ", tp, " ranks"));
  return absl::OkStatus();
}

}  // namespace

absl::Status ReducePartialGrads(Model& model) {
  const TensorParallelModel* tp = TensorParallelOf(model);
  if (!tp || model.memory().device() == Device::kMeta) return absl::OkStatus();
  std::vector<Param>& params = model.params();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor& g = params[i].grad;
    if (!g.defined() || !tp->ShardOf(static_cast<int>(i)).partial_grad) continue;
    try {
      tp->tensor_parallel().AllReduce(g.raw(), g.numel(), g.dtype());
    } catch (const std::runtime_error& e) {
      return absl::InternalError(
          absl::StrCat("summing the gradient of ", params[i].name, " over the tensor-parallel group: ", e.what()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> TensorParallelGradSquaredNorm(Model& model, const std::string& when) {
  const TensorParallelModel* tp = TensorParallelOf(model);
  absl::StatusOr<double> local = GradSquaredNorm(model, when);  // names a non-finite gradient of this rank
  if (!tp) return local;
  double split = 0, replicated = 0;
  if (local.ok() && model.memory().device() != Device::kMeta) {
    std::vector<Param>& params = model.params();
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& g = params[i].grad;
      if (!g.defined()) continue;
      const double s = g.dtype() == DType::kF64 ? SumSquares<double>(g) : SumSquares<float>(g);
      (tp->ShardOf(static_cast<int>(i)).split == TpSplit::kReplicated ? replicated : split) += s;
    }
  }
  std::vector<double> sums = {local.ok() ? split : NAN};
  if (dist::Communicator* comm = tp->tensor_parallel().comm)
    if (absl::Status s = comm->AllReduce(sums); !s.ok()) return s;
  if (!local.ok()) return local.status();
  if (!std::isfinite(sums[0]))
    return absl::InternalError(absl::StrCat("a gradient is not finite on another tensor-parallel rank ", when,
                                            " (its error names the parameter)"));
  return sums[0] + replicated;
}

absl::Status SliceTensor(const Tensor& whole, TpShard shard, const TensorParallel& tp, Tensor& block) {
  if (absl::Status s = CheckBlock(whole, shard, tp.size, block); !s.ok()) return s;
  if (whole.device() == Device::kMeta || block.device() == Device::kMeta) return absl::OkStatus();
  std::vector<std::vector<char>> copies;  // either side may be device memory
  const char* src = static_cast<const char*>(HostBytes(whole, &copies));
  return FillFromHost(block, [&](void* out) {
    char* dst = static_cast<char*>(out);
    if (shard.split == TpSplit::kReplicated) {
      std::memcpy(dst, src, whole.nbytes());
      return absl::OkStatus();
    }
    const Layout w = LayoutOf(whole, shard), b = LayoutOf(block, shard);
    for (int64_t i = 0; i < w.rows; ++i)
      std::memcpy(dst + i * b.row_bytes, src + i * w.row_bytes + tp.rank * b.row_bytes, b.row_bytes);
    return absl::OkStatus();
  });
}

absl::Status GatherTensor(const Tensor& block, TpShard shard, const TensorParallel& tp, Tensor& whole) {
  if (absl::Status s = CheckBlock(whole, shard, tp.size, block); !s.ok()) return s;
  if (whole.device() == Device::kMeta || block.device() == Device::kMeta) return absl::OkStatus();
  std::vector<std::vector<char>> copies;  // either side may be device memory
  const void* mine = HostBytes(block, &copies);
  if (shard.split == TpSplit::kReplicated || tp.size == 1)
    return FillFromHost(whole, [&](void* dst) {
      std::memcpy(dst, mine, whole.nbytes());
      return absl::OkStatus();
    });
  if (!tp.comm) return absl::FailedPreconditionError("tensor parallel: gathering needs the group's communicator");
  // Bytes travel as int32 words (bf16 blocks may have an odd element count).
  const int64_t words = (static_cast<int64_t>(block.nbytes()) + 3) / 4;
  std::vector<int32_t> padded(words, 0), all(words * tp.size);
  std::memcpy(padded.data(), mine, block.nbytes());
  if (absl::Status s = tp.comm->AllGather(padded.data(), all.data(), words, DType::kI32); !s.ok()) return s;
  const Layout b = LayoutOf(block, shard), w = LayoutOf(whole, shard);
  return FillFromHost(whole, [&](void* out) {
    char* dst = static_cast<char*>(out);
    for (int r = 0; r < tp.size; ++r) {
      const char* src = reinterpret_cast<const char*>(all.data() + r * words);
      for (int64_t i = 0; i < b.rows; ++i)
        std::memcpy(dst + i * w.row_bytes + r * b.row_bytes, src + i * b.row_bytes, b.row_bytes);
    }
    return absl::OkStatus();
  });
}

namespace {
// Pairs the two models' parameters by name, in order.
absl::Status ForEachPair(Model& whole, Model& split,
                         const std::function<absl::Status(Param&, Param&, TpShard, const TensorParallel&)>& f) {
  const auto* tp = dynamic_cast<const TensorParallelModel*>(&split);
  if (!tp) return absl::InvalidArgumentError("tensor parallel: the split model is not a tensor-parallel model");
  std::vector<Param>& w = whole.params();
  std::vector<Param>& s = split.params();
  if (w.size() != s.size())
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallel: the whole model has ", w.size(), " parameters, the split one ", s.size()));
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i].name != s[i].name)
      return absl::InvalidArgumentError(absl::StrCat("tensor parallel: parameter ", i, " is ", w[i].name,
                                                     " in the whole model but ", s[i].name, " in the split one"));
    if (absl::Status st = f(w[i], s[i], tp->ShardOf(static_cast<int>(i)), tp->tensor_parallel()); !st.ok())
      return absl::Status(st.code(), absl::StrCat(w[i].name, ": ", st.message()));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status ScatterParams(Model& whole, Model& split) {
  return ForEachPair(whole, split, [](Param& w, Param& s, TpShard shard, const TensorParallel& tp) {
    return SliceTensor(w.value, shard, tp, s.value);
  });
}

absl::Status GatherParams(Model& split, Model& whole) {
  return ForEachPair(whole, split, [](Param& w, Param& s, TpShard shard, const TensorParallel& tp) {
    return GatherTensor(s.value, shard, tp, w.value);
  });
}

absl::Status GatherGrads(Model& split, Model& whole) {
  return ForEachPair(whole, split, [](Param& w, Param& s, TpShard shard, const TensorParallel& tp) {
    if (!w.grad.defined() || !s.grad.defined()) return absl::OkStatus();
    return GatherTensor(s.grad, shard, tp, w.grad);
  });
}

}  // namespace sg
