#include "core/kv_pages.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/checked.h"

namespace sg {
namespace {
// page_size x kv_heads x head_dim, checked: a pool whose size overflows is out of memory, before any allocation.
// Page indices are int32, so at most 2^31 - 1 pages.
int64_t PageStride(int64_t capacity, int64_t page_size, int64_t kv_heads, int64_t head_dim) {
  int64_t stride = 0;
  if (capacity < 0 || capacity > INT32_MAX || !CheckedMul(page_size, kv_heads, &stride) ||
      !CheckedMul(stride, head_dim, &stride))
    throw OutOfMemory("out of memory: a KV page pool of " + std::to_string(capacity) + " pages of " +
                      std::to_string(page_size) + " tokens x " + std::to_string(kv_heads) + " heads x " +
                      std::to_string(head_dim) + " is too large to address");
  return stride;
}
}  // namespace

PagePool::PagePool(MemoryTracker* tracker, MemCategory category, DType dtype, int64_t capacity, int64_t page_size,
                   int64_t kv_heads, int64_t head_dim)
    : device_(tracker ? tracker->device() : Device::kCPU), tracker_(tracker), capacity_(capacity), page_size_(page_size),
      kv_heads_(kv_heads), head_dim_(head_dim), page_stride_(PageStride(capacity, page_size, kv_heads, head_dim)) {
  k_ = Tensor::Empty(tracker, category, dtype, {capacity, page_size, kv_heads, head_dim});
  v_ = Tensor::Empty(tracker, category, dtype, {capacity, page_size, kv_heads, head_dim});
  // Pop from the back: hand out low pool indices first.
  for (int64_t p = capacity - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

std::vector<int32_t>& PagePool::Table(int layer) {
  if (layer >= static_cast<int>(tables_.size())) tables_.resize(layer + 1);
  return tables_[layer];
}

int64_t PagePool::pages(int layer) const {
  return layer < static_cast<int>(tables_.size()) ? static_cast<int64_t>(tables_[layer].size()) : 0;
}

void PagePool::SkipRows(int64_t begin, int64_t end, int64_t seq_len) {
  const int64_t pages = (seq_len + page_size_ - 1) / page_size_;
  if (static_cast<int64_t>(skipped_rows_.size()) < pages) skipped_rows_.resize(pages, 0);
  for (int64_t t = begin; t < end;) {
    const int64_t run = std::min(end, (t / page_size_ + 1) * page_size_) - t;
    skipped_rows_[t / page_size_] += run;
    t += run;
  }
  // The last page counts its missing rows (past seq_len) as skipped.
  if (const int64_t tail = pages * page_size_ - seq_len; tail > 0 && begin < seq_len && end >= seq_len)
    skipped_rows_[pages - 1] += tail;
}

void PagePool::Ensure(int layer, int64_t begin, int64_t end, bool zero_new, const uint8_t* mask) {
  std::vector<int32_t>& table = Table(layer);
  const int64_t last = (end + page_size_ - 1) / page_size_;
  if (static_cast<int64_t>(table.size()) < last) table.resize(last, -1);
  for (int64_t logical = begin / page_size_; logical < last; ++logical) {
    int32_t& entry = table[logical];
    if (entry >= 0 || (mask && !mask[logical])) continue;
    if (logical < static_cast<int64_t>(skipped_rows_.size()) && skipped_rows_[logical] >= page_size_) continue;
    if (free_.empty())
      throw std::runtime_error("page pool exhausted: " + std::to_string(capacity_) + " pages of " +
                               std::to_string(page_size_) + " tokens (layer " + std::to_string(layer) + ")");
    entry = free_.back();
    free_.pop_back();
    if (zero_new) {
      k_.Rows(entry, entry + 1).SetZero();
      v_.Rows(entry, entry + 1).SetZero();
    }
  }
}

void PagePool::Release(int layer, int64_t from) {
  std::vector<int32_t>& table = Table(layer);
  const int64_t keep = (from + page_size_ - 1) / page_size_;  // pages starting before `from`
  while (static_cast<int64_t>(table.size()) > keep) {
    if (table.back() >= 0) free_.push_back(table.back());
    table.pop_back();
  }
}

void PagePool::ReleasePage(int layer, int64_t logical) {
  std::vector<int32_t>& table = Table(layer);
  if (logical >= static_cast<int64_t>(table.size()) || table[logical] < 0) return;
  free_.push_back(table[logical]);
  table[logical] = -1;
}

// Rows are copied one run per page with the device's copy op (the pools may live on a GPU).
template <typename T>
void PagePool::Gather(int layer, int64_t begin, int64_t end, T* k, T* v) const {
  const std::vector<int32_t>& table = tables_.at(layer);
  const OpTable<T>& ops = OpsFor<T>(device_);
  const int64_t row = kv_heads_ * head_dim_;
  for (int64_t t = begin; t < end;) {
    const int64_t run = std::min(end, (t / page_size_ + 1) * page_size_) - t;
    const int32_t page = table[t / page_size_];
    T* dk = k + (t - begin) * row;
    T* dv = v + (t - begin) * row;
    if (page < 0) {
      ops.fill(dk, run * row, T(0));
      ops.fill(dv, run * row, T(0));
    } else {
      const int64_t off = page * page_stride_ + (t % page_size_) * row;
      if (k_.dtype() == DType::kBF16) {  // bf16 pages under --dtype=bf16 (T = float)
        if constexpr (std::is_same_v<T, float>) {
          ops.bf16_to_f32(k_.data<uint16_t>() + off, run * row, dk);
          ops.bf16_to_f32(v_.data<uint16_t>() + off, run * row, dv);
        }
      } else {
        ops.copy(dk, k_.data<T>() + off, run * row);
        ops.copy(dv, v_.data<T>() + off, run * row);
      }
    }
    t += run;
  }
}

template <typename T>
void PagePool::Scatter(int layer, int64_t begin, int64_t end, const T* k, const T* v) {
  const std::vector<int32_t>& table = Table(layer);
  const OpTable<T>& ops = OpsFor<T>(device_);
  const int64_t row = kv_heads_ * head_dim_;
  for (int64_t t = begin; t < end;) {
    const int64_t run = std::min(end, (t / page_size_ + 1) * page_size_) - t;
    const int32_t page = table[t / page_size_];
    if (page >= 0) {
      const int64_t off = page * page_stride_ + (t % page_size_) * row;
      if (k_.dtype() == DType::kBF16) {
        if constexpr (std::is_same_v<T, float>) {
          ops.f32_to_bf16(k + (t - begin) * row, run * row, k_.data<uint16_t>() + off);
          ops.f32_to_bf16(v + (t - begin) * row, run * row, v_.data<uint16_t>() + off);
        }
      } else {
        ops.copy(k_.data<T>() + off, k + (t - begin) * row, run * row);
        ops.copy(v_.data<T>() + off, v + (t - begin) * row, run * row);
      }
    }
    t += run;
  }
}

template <typename T>
void PagePool::ScatterRoped(int layer, int64_t begin, int64_t end, const T* k, const T* v, const double* inv_freq) {
  const OpTable<T>& ops = OpsFor<T>(device_);
  if (k_.dtype() != DType::kBF16) return ops.rope_kv_write(k, v, end - begin, begin, inv_freq, View<T>(layer));
  if constexpr (std::is_same_v<T, float>) {
    if (!ops.rope_kv_write_bf16) throw std::invalid_argument("bf16 KV pages: this backend cannot write them");
    ops.rope_kv_write_bf16(k, v, end - begin, begin, inv_freq, View<uint16_t>(layer));
  }
}

template <typename T>
PagedKV<T> PagePool::View(int layer) const {
  if (DTypeSize(k_.dtype()) != sizeof(T))
    throw std::logic_error(absl::StrCat("KV pages hold ", DTypeName(k_.dtype()), ", viewed with ", sizeof(T),
                                        "-byte elements"));
  PagedKV<T> view;
  view.k_pool = k_.data<T>();
  view.v_pool = v_.data<T>();
  view.page_table = tables_.at(layer).data();
  view.page_size = page_size_;
  view.page_stride = page_stride_;
  view.kv_heads = kv_heads_;
  view.head_dim = head_dim_;
  return view;
}

template <typename T>
void PagePool::ScaleAs(int layer, int64_t begin, int64_t end, double factor) {
  const std::vector<int32_t>& table = Table(layer);
  const OpTable<T>& ops = OpsFor<T>(device_);
  const int64_t row = kv_heads_ * head_dim_;
  end = std::min(end, static_cast<int64_t>(table.size()) * page_size_);
  for (int64_t t = begin; t < end;) {  // one run of rows per page
    const int64_t run = std::min(end, (t / page_size_ + 1) * page_size_) - t;
    if (const int32_t page = table[t / page_size_]; page >= 0) {
      const int64_t off = page * page_stride_ + (t % page_size_) * row;
      if (k_.dtype() == DType::kBF16) {
        if constexpr (std::is_same_v<T, float>) {
          // The widened rows in the device's memory: a host vector on the CPU, workspace elsewhere.
          std::vector<float> host_rows(HostAddressable(device_) ? run * row : 0);
          Tensor device_rows;
          if (!HostAddressable(device_))
            device_rows = Tensor::Empty(tracker_, MemCategory::kWorkspace, DType::kF32, {run * row});
          float* rows = HostAddressable(device_) ? host_rows.data() : device_rows.data<float>();
          for (uint16_t* p : {k_.data<uint16_t>() + off, v_.data<uint16_t>() + off}) {
            ops.bf16_to_f32(p, run * row, rows);
            ops.scale(rows, run * row, factor);
            ops.f32_to_bf16(rows, run * row, p);
          }
        }
      } else {
        ops.scale(k_.data<T>() + off, run * row, factor);
        ops.scale(v_.data<T>() + off, run * row, factor);
      }
    }
    t += run;
  }
}

void PagePool::Scale(int layer, int64_t begin, int64_t end, double factor) {
  if (k_.dtype() == DType::kF64) ScaleAs<double>(layer, begin, end, factor);
  else ScaleAs<float>(layer, begin, end, factor);
}

#define SG_INSTANTIATE(T)                                                                 \
  template void PagePool::Gather<T>(int, int64_t, int64_t, T*, T*) const;                 \
  template void PagePool::Scatter<T>(int, int64_t, int64_t, const T*, const T*);          \
  template void PagePool::ScatterRoped<T>(int, int64_t, int64_t, const T*, const T*, const double*); \
  template PagedKV<T> PagePool::View<T>(int) const;
SG_INSTANTIATE(float)
SG_INSTANTIATE(double)
#undef SG_INSTANTIATE
template PagedKV<uint16_t> PagePool::View<uint16_t>(int) const;

}  // namespace sg
