// Attention of a chunk's queries over a layer's paged KV cache, visited in groups of pages: group g holds the
// logical pages [g G, (g + 1) G). Forward merges each group's (out, lse) into the running result with the
// backend's attention_merge; backward gives each group, from the final out and lse, its share of dQ (summed over
// the groups in order) and its pages' dK/dV. A chunk whose keys fit one group makes one call, as if there were no
// groups. Dense offload (KvOffload::Streams) streams the groups' pages that are not on the device through the
// offload's ring; the walk, and so the result, is the same with pages resident or streamed.
#pragma once

#include <cstdint>

#include "base/memory.h"
#include "core/kv_offload.h"
#include "core/kv_pages.h"
#include "core/model.h"
#include "kernels/backend.h"

namespace sg {

// StateOptions::attention_group's default, in tokens: long enough that most runs make one call.
constexpr int64_t kDefaultAttentionGroup = 16384;

// Pages per group for a state's options: attention_group (or the default) in whole pages, at least one.
int64_t AttentionGroupPages(const StateOptions& o);

// What attention reads and writes in one layer.
struct PagedAttention {
  PagePool* kv = nullptr;
  PagePool* grad = nullptr;  // backward: the KV-gradient pages dK/dV accumulate into
  int layer = 0;
  const uint8_t* selected = nullptr;  // sparse attention's page mask; null: every page
  int64_t group_pages = 0;
  KvOffload* stream = nullptr;      // dense offload: brings the pages that are not on the device
  MemoryTracker* memory = nullptr;  // for workspace
};

// attention_forward (or its bf16-page form) over the groups: out[n][heads][head_dim], lse[heads][n].
template <typename T>
void PagedAttentionForward(const OpTable<T>& ops, const AttentionShape& s, const PagedAttention& a, const T* q, T* out,
                           T* lse);
// attention_backward over the groups: dq assigned; dK/dV accumulated into the gradient pages of every key
// [0, pos0 + n), which it creates (zeroed) where missing.
template <typename T>
void PagedAttentionBackward(const OpTable<T>& ops, const AttentionShape& s, const PagedAttention& a, const T* q,
                            const T* out, const T* lse, const T* dout, T* dq);

}  // namespace sg
