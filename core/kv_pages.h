// Paged KV cache and KV-gradient pages (SeCOv2 §4.1): fixed-size pages from a pool preallocated once per
// sequence; a per-layer page table maps logical pages to pool pages. Nothing is concatenated or reallocated as
// the cache grows, and pages whose tokens are finished go back to the free list.
#pragma once

#include <cstdint>
#include <vector>

#include "base/tensor.h"
#include "kernels/backend.h"

namespace sg {

class PagePool {
 public:
  // capacity pages of page_size tokens x kv_heads x head_dim, for K and for V.
  PagePool(MemoryTracker* tracker, MemCategory category, DType dtype, int64_t capacity, int64_t page_size,
           int64_t kv_heads, int64_t head_dim);

  // Makes the logical pages of `layer` that overlap rows [begin, end) exist (new ones zeroed when zero_new), except
  // pages whose every row was passed to SkipRows and, given a mask over logical pages, unselected ones. The table
  // grows to cover `end`; entries it leaves out are -1 (absent: reads give zeros, attention skips them).
  void Ensure(int layer, int64_t begin, int64_t end, bool zero_new, const uint8_t* mask = nullptr);
  // Rows [begin, end) of a sequence of seq_len tokens will never be read (in any layer), e.g. the gradient of
  // positions whose chunk is not backpropagated: pages made only of such rows are left out.
  void SkipRows(int64_t begin, int64_t end, int64_t seq_len);
  // Returns the layer's pages that start at or after position `from` to the free list.
  void Release(int layer, int64_t from);
  // Returns one logical page to the free list (its entry becomes -1); nothing if it is absent.
  void ReleasePage(int layer, int64_t logical);
  // Rows [begin, end) of K and V for one layer, gathered into dense [n][kv_heads][head_dim] arrays (zeros for
  // rows of pages left out).
  template <typename T> void Gather(int layer, int64_t begin, int64_t end, T* k, T* v) const;
  // Writes dense rows [begin, end) into the pages (Ensure must cover end).
  template <typename T> void Scatter(int layer, int64_t begin, int64_t end, const T* k, const T* v);
  // Scatter with k roped at positions begin.. (RoPE frequencies inv_freq), in one pass (OpTable::rope_kv_write).
  template <typename T>
  void ScatterRoped(int layer, int64_t begin, int64_t end, const T* k, const T* v, const double* inv_freq);
  template <typename T> PagedKV<T> View(int layer) const;
  // Multiplies rows [begin, end) of K and V by factor; rows in pages that do not exist yet are zero and stay so.
  void Scale(int layer, int64_t begin, int64_t end, double factor);

  int64_t page_size() const { return page_size_; }
  DType dtype() const { return k_.dtype(); }
  int64_t pages_in_use() const { return capacity_ - static_cast<int64_t>(free_.size()); }
  int64_t capacity() const { return capacity_; }

  // For copies between the pool and host memory (core/kv_offload.h): the layer's logical pages, the pool page
  // behind one of them (-1: left out), and the address of a row of a pool page in K and in V.
  int64_t pages(int layer) const;
  int32_t pool_page(int layer, int64_t logical) const { return tables_[layer][logical]; }
  char* k_row(int32_t pool_page, int64_t row) const { return RowAddress(k_, pool_page, row); }
  char* v_row(int32_t pool_page, int64_t row) const { return RowAddress(v_, pool_page, row); }
  int64_t row_bytes() const { return kv_heads_ * head_dim_ * static_cast<int64_t>(DTypeSize(k_.dtype())); }

 private:
  std::vector<int32_t>& Table(int layer);
  char* RowAddress(const Tensor& t, int32_t pool_page, int64_t row) const {
    return static_cast<char*>(t.raw()) + (pool_page * page_size_ + row) * row_bytes();
  }
  template <typename T> void ScaleAs(int layer, int64_t begin, int64_t end, double factor);
  Device device_;
  MemoryTracker* tracker_;  // for workspace on a device that is not host-addressable
  Tensor k_, v_;
  int64_t capacity_, page_size_, kv_heads_, head_dim_, page_stride_;
  std::vector<int32_t> free_;
  std::vector<int64_t> skipped_rows_;  // per logical page
  std::vector<std::vector<int32_t>> tables_;
};

}  // namespace sg
