#include "core/kv_offload.h"

#include <algorithm>
#include <stdexcept>

namespace sg {

KvOffload::KvOffload(PagePool& kv, PagePool* grad, const CopyEngine& copies, int layers, int64_t seq_len, int slots)
    : kv_(kv), grad_(grad), copies_(copies), page_size_(kv.page_size()),
      rows_per_layer_((seq_len + kv.page_size() - 1) / kv.page_size() * kv.page_size()), row_bytes_(kv.row_bytes()),
      home_kv_rows_(layers, 0), home_grad_pages_(layers), slots_(std::min(slots, layers)) {
  // A prefetch that evicts must find a slot other than the current layer's.
  if (slots < 2 && layers > 1) throw std::invalid_argument("KV offload needs at least 2 slots");
  if (!copies_.alloc_host || !copies_.copy_async || !copies_.wait)
    throw std::invalid_argument("--offload: the device's backend has no copy engine");
  kv_home_ = AllocHome();
  if (grad_) grad_home_ = AllocHome();
}

KvOffload::~KvOffload() {
  copies_.wait(kFetchLane);
  copies_.wait(kWriteBackLane);
  for (const Home& h : {kv_home_, grad_home_})
    for (char* p : {h.k, h.v})
      if (p) copies_.free_host(p);
}

KvOffload::Home KvOffload::AllocHome() {
  const int64_t bytes = static_cast<int64_t>(home_kv_rows_.size()) * rows_per_layer_ * row_bytes_;
  Home h;
  h.k = static_cast<char*>(copies_.alloc_host(bytes));
  h.v = static_cast<char*>(copies_.alloc_host(bytes));
  host_bytes_ += 2 * bytes;
  return h;
}

void KvOffload::Visit(const LayerAccess& now, const LayerAccess& next) {
  ++clock_;
  Slot& s = Fetch(now, /*keep=*/-1, /*drop_unread=*/true);
  // The pages must have arrived, and no write-back may still be reading pages this visit may change.
  if (s.fetching) Wait(kFetchLane);
  if (s.writing_back) Wait(kWriteBackLane);
  if (now.kv_appended.size() > 0)
    s.kv_dirty = s.kv_dirty.size() > 0 ? Chunk{std::min(s.kv_dirty.begin, now.kv_appended.begin),
                                               std::max(s.kv_dirty.end, now.kv_appended.end)}
                                       : now.kv_appended;
  if (now.grad_rows > 0) s.grad_dirty = true;
  // Prefetch before the write-back is issued: an eviction for the prefetch then waits only for older write-backs.
  // (A prefetch for this same layer, e.g. its backward after its forward, must not drop pages this visit reads.)
  if (next.layer >= 0) Fetch(next, /*keep=*/now.layer, /*drop_unread=*/next.layer != now.layer);
  if (previous_ >= 0 && previous_ != now.layer)
    if (const int p = FindSlot(previous_); p >= 0) WriteBack(slots_[p]);
  previous_ = now.layer;
}

void KvOffload::Require(const LayerAccess& access) {
  Slot& s = Fetch(access, /*keep=*/-1, /*drop_unread=*/true);
  if (s.fetching) Wait(kFetchLane);
}

void KvOffload::Release(int layer, int64_t from) {
  home_kv_rows_[layer] = std::min(home_kv_rows_[layer], from);
  std::vector<uint8_t>& home_grad = home_grad_pages_[layer];
  home_grad.resize(std::min<size_t>(home_grad.size(), (from + page_size_ - 1) / page_size_));
  const int index = FindSlot(layer);
  if (index < 0) return;
  Slot& s = slots_[index];
  // The pool is about to hand these pages out again.
  if (s.writing_back) Wait(kWriteBackLane);
  if (s.fetching) Wait(kFetchLane);
  s.kv_dirty.end = std::min(s.kv_dirty.end, from);
  if (s.kv_dirty.size() <= 0) s.kv_dirty = {};
}

KvOffload::Slot& KvOffload::Fetch(const LayerAccess& a, int keep, bool drop_unread) {
  int index = FindSlot(a.layer);
  if (index < 0) {
    for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
      if (slots_[i].layer < 0) {  // a free slot
        index = i;
        break;
      }
      if (slots_[i].layer == keep) continue;
      if (index < 0 || slots_[i].last_use < slots_[index].last_use) index = i;
    }
    if (slots_[index].layer >= 0) Evict(slots_[index]);
    slots_[index].layer = a.layer;
  }
  Slot& s = slots_[index];
  s.last_use = clock_;
  if (drop_unread && !a.pages.empty()) DropUnread(s, a);
  // K/V: the pages read, with the rows home holds (rows past them are on the device already or not computed yet).
  const int64_t kv_end = std::min(a.kv_rows, home_kv_rows_[a.layer]);
  for (int64_t p = 0; p * page_size_ < kv_end; ++p) {
    if (!a.reads(p) || (p < kv_.pages(a.layer) && kv_.pool_page(a.layer, p) >= 0)) continue;
    kv_.Ensure(a.layer, p * page_size_, (p + 1) * page_size_, /*zero_new=*/false);
    CopyRows(kv_, kv_home_, a.layer, p * page_size_, std::min(kv_end, (p + 1) * page_size_), /*to_device=*/true);
    s.fetching = true;
  }
  // Gradients: whole pages that home holds; the backward creates the others zeroed.
  if (grad_ && a.grad_rows > 0) {
    const std::vector<uint8_t>& home = home_grad_pages_[a.layer];
    for (int64_t p = 0; p * page_size_ < a.grad_rows && p < static_cast<int64_t>(home.size()); ++p) {
      if (!home[p] || !a.reads(p) || (p < grad_->pages(a.layer) && grad_->pool_page(a.layer, p) >= 0)) continue;
      grad_->Ensure(a.layer, p * page_size_, (p + 1) * page_size_, /*zero_new=*/false);
      CopyRows(*grad_, grad_home_, a.layer, p * page_size_, (p + 1) * page_size_, /*to_device=*/true);
      s.fetching = true;
    }
  }
  return s;
}

void KvOffload::DropUnread(Slot& s, const LayerAccess& a) {
  auto unread = [&](const PagePool& pool, int64_t p) { return !a.reads(p) && pool.pool_page(s.layer, p) >= 0; };
  std::vector<int64_t> kv_pages, grad_pages;
  for (int64_t p = 0; p < kv_.pages(s.layer); ++p)
    if (unread(kv_, p)) kv_pages.push_back(p);
  for (int64_t p = 0; grad_ && p < grad_->pages(s.layer); ++p)
    if (unread(*grad_, p)) grad_pages.push_back(p);
  if (kv_pages.empty() && grad_pages.empty()) return;
  WriteBack(s);
  if (s.writing_back) Wait(kWriteBackLane);
  if (s.fetching) Wait(kFetchLane);
  for (int64_t p : kv_pages) kv_.ReleasePage(s.layer, p);
  for (int64_t p : grad_pages) grad_->ReleasePage(s.layer, p);
}

void KvOffload::WriteBack(Slot& s) {
  if (s.kv_dirty.size() > 0) {
    CopyRows(kv_, kv_home_, s.layer, s.kv_dirty.begin, s.kv_dirty.end, /*to_device=*/false);
    // Rows are appended in order, so what home holds stays a prefix.
    home_kv_rows_[s.layer] = std::max(home_kv_rows_[s.layer], s.kv_dirty.end);
    s.kv_dirty = {};
    s.writing_back = true;
  }
  if (s.grad_dirty) {  // a backward accumulates into every gradient page the layer has on the device
    const int64_t pages = grad_->pages(s.layer);
    std::vector<uint8_t>& home = home_grad_pages_[s.layer];
    if (static_cast<int64_t>(home.size()) < pages) home.resize(pages, 0);
    for (int64_t p = 0; p < pages; ++p)
      if (grad_->pool_page(s.layer, p) >= 0) {
        CopyRows(*grad_, grad_home_, s.layer, p * page_size_, (p + 1) * page_size_, /*to_device=*/false);
        home[p] = 1;
      }
    s.grad_dirty = false;
    s.writing_back = true;
  }
}

void KvOffload::Evict(Slot& s) {
  WriteBack(s);
  if (s.writing_back) Wait(kWriteBackLane);
  if (s.fetching) Wait(kFetchLane);
  kv_.Release(s.layer, 0);
  if (grad_) grad_->Release(s.layer, 0);
  s = Slot{};
}

std::vector<uint8_t> KvOffload::ChunkPageMask(Chunk c, int64_t page_size) {
  const int64_t first = c.begin / page_size, end = std::max(first + 1, (c.end + page_size - 1) / page_size);
  std::vector<uint8_t> mask(end, 0);
  std::fill(mask.begin() + first, mask.end(), 1);
  return mask;
}

void KvOffload::StreamGroup(int layer, const std::vector<int64_t>& pages, bool grad) {
  auto resident = [&](const PagePool& pool, int64_t p) { return p < pool.pages(layer) && pool.pool_page(layer, p) >= 0; };
  Group g;
  g.layer = layer;
  for (int64_t p : pages) {
    if (resident(kv_, p)) continue;
    kv_.Ensure(layer, p * page_size_, (p + 1) * page_size_, /*zero_new=*/false);
    CopyRows(kv_, kv_home_, layer, p * page_size_, std::min(home_kv_rows_[layer], (p + 1) * page_size_),
             /*to_device=*/true);
    g.kv.push_back(p);
  }
  if (grad && grad_) {
    const std::vector<uint8_t>& home = home_grad_pages_[layer];
    for (int64_t p : pages) {
      if (resident(*grad_, p)) continue;
      const bool at_home = p < static_cast<int64_t>(home.size()) && home[p];
      grad_->Ensure(layer, p * page_size_, (p + 1) * page_size_, /*zero_new=*/!at_home);
      if (!resident(*grad_, p)) continue;  // nobody needs its gradient (PagePool::SkipRows)
      if (at_home) CopyRows(*grad_, grad_home_, layer, p * page_size_, (p + 1) * page_size_, /*to_device=*/true);
      g.grad.push_back(p);
    }
  }
  streamed_.push_back(std::move(g));
}

void KvOffload::AwaitGroup() { Wait(kFetchLane); }

void KvOffload::FinishGroup() {
  if (streamed_.empty()) throw std::logic_error("KvOffload::FinishGroup: no group streamed");
  Group g = std::move(streamed_.front());
  streamed_.erase(streamed_.begin());
  for (int64_t p : g.kv) kv_.ReleasePage(g.layer, p);  // read only: a later copy into the page waits for compute
  if (g.grad.empty()) return;
  FlushGroups();  // the previous group's write-back has had this group's compute to finish
  std::vector<uint8_t>& home = home_grad_pages_[g.layer];
  for (int64_t p : g.grad) {
    CopyRows(*grad_, grad_home_, g.layer, p * page_size_, (p + 1) * page_size_, /*to_device=*/false);
    if (static_cast<int64_t>(home.size()) <= p) home.resize(p + 1, 0);
    home[p] = 1;
  }
  written_ = std::move(g);
}

void KvOffload::FlushGroups() {
  if (written_.grad.empty()) return;
  Wait(kWriteBackLane);
  for (int64_t p : written_.grad) grad_->ReleasePage(written_.layer, p);
  written_ = Group{};
}

void KvOffload::Wait(int lane) {
  copies_.wait(lane);
  for (Slot& s : slots_) (lane == kFetchLane ? s.fetching : s.writing_back) = false;
}

int KvOffload::FindSlot(int layer) const {
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i)
    if (slots_[i].layer == layer) return i;
  return -1;
}

void KvOffload::CopyRows(PagePool& pool, const Home& home, int layer, int64_t begin, int64_t end, bool to_device) {
  for (int64_t t = begin; t < end;) {
    const int64_t run = std::min(end, (t / page_size_ + 1) * page_size_) - t;
    if (const int32_t page = pool.pool_page(layer, t / page_size_); page >= 0) {
      const int64_t at = (layer * rows_per_layer_ + t) * row_bytes_, bytes = run * row_bytes_;
      char* device_k = pool.k_row(page, t % page_size_);
      char* device_v = pool.v_row(page, t % page_size_);
      if (to_device) {
        copies_.copy_async(device_k, home.k + at, bytes, kFetchLane);
        copies_.copy_async(device_v, home.v + at, bytes, kFetchLane);
        fetched_bytes_ += 2 * bytes;
      } else {
        copies_.copy_async(home.k + at, device_k, bytes, kWriteBackLane);
        copies_.copy_async(home.v + at, device_v, bytes, kWriteBackLane);
        written_back_bytes_ += 2 * bytes;
      }
    }
    t += run;
  }
}

}  // namespace sg
