#include "core/paged_attention.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace sg {
namespace {

// The selected pages of each non-empty group over logical pages [begin, pages), in order.
std::vector<std::vector<int64_t>> Groups(const PagedAttention& a, int64_t begin, int64_t pages) {
  std::vector<std::vector<int64_t>> groups;
  for (int64_t first = 0; first < pages; first += a.group_pages) {
    std::vector<int64_t> group;
    for (int64_t p = std::max(first, begin); p < std::min(pages, first + a.group_pages); ++p)
      if (a.selected == nullptr || a.selected[p]) group.push_back(p);
    if (!group.empty()) groups.push_back(std::move(group));
  }
  return groups;
}

// Runs call(mask, first) for every group of the pages holding keys [s.key_begin, pos0 + n) in order (mask null:
// one group of every selected page), streaming the groups' pages with the offload's ring when there is one: group
// i + 1 is fetched while group i computes. Pages wholly before key_begin (earlier documents) are never visited.
template <typename Call>
void Walk(const PagedAttention& a, const AttentionShape& s, bool grad, Call call) {
  const int64_t ps = a.kv->page_size(), begin = s.key_begin / ps, pages = (s.pos0 + s.n + ps - 1) / ps;
  if (!a.stream && begin / a.group_pages == (pages - 1) / a.group_pages) {  // one group
    call(a.selected, /*first=*/true);
    return;
  }
  const std::vector<std::vector<int64_t>> groups = Groups(a, begin, pages);
  std::vector<uint8_t> mask(groups.size() > 1 ? pages : 0, 0);  // the group's pages, set while it computes
  if (a.stream && !groups.empty()) a.stream->StreamGroup(a.layer, groups[0], grad);
  for (size_t i = 0; i < groups.size(); ++i) {
    if (a.stream) {
      a.stream->AwaitGroup();
      if (i + 1 < groups.size()) a.stream->StreamGroup(a.layer, groups[i + 1], grad);
    }
    if (groups.size() == 1) {
      call(a.selected, /*first=*/true);
    } else {
      for (int64_t p : groups[i]) mask[p] = 1;
      call(mask.data(), /*first=*/i == 0);
      for (int64_t p : groups[i]) mask[p] = 0;
    }
    if (a.stream) a.stream->FinishGroup();
  }
  if (a.stream) a.stream->FlushGroups();
}

template <typename T>
Tensor Workspace(const PagedAttention& a, std::vector<int64_t> shape) {
  return Tensor::Empty(a.memory, MemCategory::kWorkspace, std::is_same_v<T, double> ? DType::kF64 : DType::kF32,
                       std::move(shape));
}

}  // namespace

int64_t AttentionGroupPages(const StateOptions& o) {
  const int64_t tokens = o.attention_group > 0 ? o.attention_group : kDefaultAttentionGroup;
  return std::max<int64_t>(1, tokens / o.page_size);
}

template <typename T>
void PagedAttentionForward(const OpTable<T>& ops, const AttentionShape& s, const PagedAttention& a, const T* q, T* out,
                           T* lse) {
  Tensor ws = Workspace<T>(a, {ops.attention_workspace_elems(s, a.kv->page_size())});
  Tensor group_out, group_lse;  // a later group's result, merged into out and lse
  Walk(a, s, /*grad=*/false, [&](const uint8_t* mask, bool first) {
    if (!first && !group_out.defined()) {
      group_out = Workspace<T>(a, {s.n * s.heads * s.head_dim});
      group_lse = Workspace<T>(a, {s.heads * s.n});
    }
    T* o = first ? out : group_out.data<T>();
    T* l = first ? lse : group_lse.data<T>();
    if (a.kv->dtype() == DType::kBF16) {  // --dtype=bf16 pages (T = float)
      if constexpr (std::is_same_v<T, float>) {
        PagedKV<uint16_t> view = a.kv->View<uint16_t>(a.layer);
        view.page_mask = mask;
        ops.attention_forward_bf16(s, q, view, o, l, ws.data<T>());
      }
    } else {
      PagedKV<T> view = a.kv->View<T>(a.layer);
      view.page_mask = mask;
      ops.attention_forward(s, q, view, o, l, ws.data<T>());
    }
    if (!first) ops.attention_merge(s, out, lse, o, l);
  });
}

template <typename T>
void PagedAttentionBackward(const OpTable<T>& ops, const AttentionShape& s, const PagedAttention& a, const T* q,
                            const T* out, const T* lse, const T* dout, T* dq) {
  // Only the selected pages receive gradients (and exist). Streamed, the chunk's own pages are made here and the
  // others by the ring, a group at a time.
  a.grad->Ensure(a.layer, a.stream ? s.pos0 : s.key_begin, s.pos0 + s.n, /*zero_new=*/true, a.selected);
  Tensor ws = Workspace<T>(a, {ops.attention_workspace_elems(s, a.kv->page_size())});
  Tensor group_dq;  // a later group's share of dq
  Walk(a, s, /*grad=*/true, [&](const uint8_t* mask, bool first) {
    if (!first && !group_dq.defined()) group_dq = Workspace<T>(a, {s.n * s.heads * s.head_dim});
    T* d = first ? dq : group_dq.data<T>();
    if (a.kv->dtype() == DType::kBF16) {
      if constexpr (std::is_same_v<T, float>) {
        PagedKV<uint16_t> view = a.kv->View<uint16_t>(a.layer), grad_view = a.grad->View<uint16_t>(a.layer);
        view.page_mask = grad_view.page_mask = mask;
        ops.attention_backward_bf16(s, q, view, out, lse, dout, d, grad_view, ws.data<T>());
      }
    } else {
      PagedKV<T> view = a.kv->View<T>(a.layer), grad_view = a.grad->View<T>(a.layer);
      view.page_mask = grad_view.page_mask = mask;
      ops.attention_backward(s, q, view, out, lse, dout, d, grad_view, ws.data<T>());
    }
    if (!first) ops.add_inplace(dq, d, s.n * s.heads * s.head_dim);
  });
}

template void PagedAttentionForward<float>(const OpTable<float>&, const AttentionShape&, const PagedAttention&,
                                           const float*, float*, float*);
template void PagedAttentionForward<double>(const OpTable<double>&, const AttentionShape&, const PagedAttention&,
                                            const double*, double*, double*);
template void PagedAttentionBackward<float>(const OpTable<float>&, const AttentionShape&, const PagedAttention&,
                                            const float*, const float*, const float*, const float*, float*);
template void PagedAttentionBackward<double>(const OpTable<double>&, const AttentionShape&, const PagedAttention&,
                                             const double*, const double*, const double*, const double*, double*);

}  // namespace sg
