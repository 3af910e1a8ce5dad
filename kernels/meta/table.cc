#include <cstdint>
#include <type_traits>

#include "kernels/meta/meta_ops.h"

namespace sg::meta {
namespace {

// The no-op of an op table entry's function-pointer type: returns a zero of its result type.
template <typename F>
struct Nop;
template <typename R, typename... Args>
struct Nop<R (*)(Args...)> {
  static R Call(Args...) {
    if constexpr (!std::is_void_v<R>) return R{};
  }
};
#define SG_META_NOP(table, op) (table).op = &Nop<decltype((table).op)>::Call

template <typename T>
OpTable<T> MakeTable() {
  OpTable<T> t{};
  SG_META_NOP(t, gemm);
  SG_META_NOP(t, embedding_forward);
  SG_META_NOP(t, embedding_backward);
  SG_META_NOP(t, rmsnorm_forward);
  SG_META_NOP(t, rmsnorm_backward);
  SG_META_NOP(t, rope);
  SG_META_NOP(t, add_bias);
  SG_META_NOP(t, bias_backward);
  SG_META_NOP(t, swiglu_forward);
  SG_META_NOP(t, swiglu_backward);
  SG_META_NOP(t, add_inplace);
  SG_META_NOP(t, copy);
  SG_META_NOP(t, fill);
  SG_META_NOP(t, scale);
  SG_META_NOP(t, attention_forward);
  SG_META_NOP(t, attention_backward);
  t.attention_workspace_elems = CpuOps<T>().attention_workspace_elems;  // sizes only: reads no tensor
  SG_META_NOP(t, cross_entropy_forward_backward);
  SG_META_NOP(t, token_logprobs);
  SG_META_NOP(t, token_argmax);
  SG_META_NOP(t, conv1d_forward);
  SG_META_NOP(t, conv1d_backward);
  SG_META_NOP(t, selective_scan_forward);
  SG_META_NOP(t, selective_scan_backward);
  SG_META_NOP(t, selective_scan_backward_pairs);
  SG_META_NOP(t, silu_forward);
  SG_META_NOP(t, silu_backward);
  SG_META_NOP(t, softplus_forward);
  SG_META_NOP(t, softplus_backward);
  SG_META_NOP(t, adamw);
  // bf16 storage: planned like the CPU backend, which has it.
  SG_META_NOP(t, gemm_mixed);
  SG_META_NOP(t, bf16_to_f32);
  SG_META_NOP(t, f32_to_bf16);
  SG_META_NOP(t, cross_entropy_bf16);
  SG_META_NOP(t, token_logprobs_bf16);
  SG_META_NOP(t, token_argmax_bf16);
  SG_META_NOP(t, attention_forward_bf16);
  SG_META_NOP(t, attention_backward_bf16);
  SG_META_NOP(t, adamw_bf16);
  SG_META_NOP(t, lora_dropout);
  SG_META_NOP(t, ssm_neg_exp);
  SG_META_NOP(t, ssm_neg_exp_backward);
  SG_META_NOP(t, column_sums_f64);
  SG_META_NOP(t, page_scores);
  SG_META_NOP(t, attention_merge);
  // Tensor parallelism's vocabulary shards.
  SG_META_NOP(t, embedding_shard_forward);
  SG_META_NOP(t, embedding_shard_backward);
  SG_META_NOP(t, vocab_shard_max);
  SG_META_NOP(t, vocab_shard_sums);
  SG_META_NOP(t, vocab_shard_gradient);
  SG_META_NOP(t, embedding_shard_forward_bf16);
  SG_META_NOP(t, vocab_shard_max_bf16);
  SG_META_NOP(t, vocab_shard_sums_bf16);
  SG_META_NOP(t, vocab_shard_gradient_bf16);
  SG_META_NOP(t, round_bf16);
  SG_META_NOP(t, rope_kv_write);
  SG_META_NOP(t, rope_kv_write_bf16);
  SG_META_NOP(t, rmsnorm_forward_bf16);
  SG_META_NOP(t, swiglu_forward_bf16);
  SG_META_NOP(t, swiglu_backward_bf16);
  return t;
}
#undef SG_META_NOP

// Every entry set: a field added to OpTable and forgotten here would stay null and crash a meta walk.
template <typename T>
bool AllSet(const OpTable<T>& t) {
  const auto* p = reinterpret_cast<void* const*>(&t);
  for (size_t i = 0; i < sizeof(t) / sizeof(void*); ++i)
    if (!p[i]) return false;
  return true;
}

}  // namespace

template <typename T>
const OpTable<T>& MetaOps() {
  static const OpTable<T> table = [] {
    OpTable<T> t = MakeTable<T>();
    if (!AllSet(t)) __builtin_trap();
    return t;
  }();
  return table;
}
template const OpTable<float>& MetaOps<float>();
template const OpTable<double>& MetaOps<double>();

CopyEngine MetaCopyEngine() {
  CopyEngine e;
  e.alloc_host = [](size_t) { return MetaAddress(); };
  e.free_host = [](void*) {};
  e.copy_async = [](void*, const void*, size_t, int) {};
  e.wait = [](int) {};
  return e;
}

DeviceBackend MetaBackend() {
  DeviceBackend b;
  b.f32 = &MetaOps<float>();
  b.f64 = &MetaOps<double>();
  b.synchronize = [] {};
  b.name = [] { return std::string("meta (no storage, no compute: memory planning)"); };
  b.copies = MetaCopyEngine();
  return b;
}

}  // namespace sg::meta
