// Asynchronous KV offload (SeCOv2 §4.2): every layer's KV pages and KV-gradient pages have their home in host
// memory, and the device page pools hold only a few layers ("slots"): the layer being computed, the one the
// schedule touches next (prefetched on one copy lane) and the one before (written back on another lane). Device
// memory for the cache is then flat in the number of layers.
// Dense attention (no sparse pages) goes further: a slot holds only the pages of the chunk being computed, and
// attention streams the layer's other pages through a small ring of device pages a group at a time
// (core/paged_attention.h: the next group is fetched while one computes, gradient pages go home behind it), so
// device memory for the cache is flat in the sequence length too.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kv_pages.h"
#include "core/model.h"
#include "kernels/backend.h"

namespace sg {

// What one visit of a layer reads and writes, in token positions.
struct LayerAccess {
  int layer = -1;         // -1: no layer
  int64_t kv_rows = 0;    // reads K/V rows [0, kv_rows)
  Chunk kv_appended;      // writes (appends) these K/V rows; empty: none
  int64_t grad_rows = 0;  // reads and accumulates into the gradient pages of rows [0, grad_rows); 0: none
  // Sparse attention (SeCOv2 §4.3): of those rows, only the pages p with pages[p] != 0 (it covers every page the
  // visit reads, and the appended rows' pages are among them); empty: all. The layer's other pages leave the device.
  std::vector<uint8_t> pages;
  bool reads(int64_t page) const { return pages.empty() || (page < static_cast<int64_t>(pages.size()) && pages[page]); }
};

class KvOffload {
 public:
  static constexpr int kSlots = 3;
  static constexpr int kFetchLane = 0, kWriteBackLane = 1;

  // kv and grad (null: the state has no gradient pages) hold min(slots, layers) layers of pages each; every
  // layer's home holds seq_len rows (whole pages) of K and V, and of dK and dV.
  KvOffload(PagePool& kv, PagePool* grad, const CopyEngine& copies, int layers, int64_t seq_len, int slots = kSlots);
  ~KvOffload();  // waits for the copies in flight
  KvOffload(const KvOffload&) = delete;
  KvOffload& operator=(const KvOffload&) = delete;

  // Before the layer of `now` runs: makes its pages resident (waiting for its prefetch, or fetching what is
  // missing), prefetches `next` (the visit the schedule makes after this one; layer -1: none) and sends home
  // what the previous visit, of another layer, wrote.
  void Visit(const LayerAccess& now, const LayerAccess& next);
  // Makes the access's pages resident now, for a visit under way that learned more of what it reads (sparse
  // attention's selection, made from the chunk's queries after the visit began).
  void Require(const LayerAccess& access);
  // Before the pools free the layer's pages of positions >= from: nothing of them is needed any more, at home
  // or on the device; copies still reading or writing the layer's pages finish first.
  void Release(int layer, int64_t from);

  // Sparse attention with k selected pages and chunks of `chunk` tokens: the most pages a visit reads in one layer
  // (page 0, the k selected, the chunk's own pages and the one before), so what a resident layer needs at most.
  static int64_t SparsePagesPerLayer(int64_t k, int64_t chunk, int64_t page_size) {
    return k + (chunk + page_size - 1) / page_size + 3;
  }

  // Streaming (dense offload, o.chunk > 0): the pages of a chunk of o.chunk tokens, which a slot holds, and the
  // device pages of each pool: slots x the chunk's pages + the ring (K/V: the group computing and the next one
  // being fetched; gradients: also the one before, being written back). Groups of group_pages pages.
  static bool Streams(const StateOptions& o) { return o.offload && o.sparse_pages == 0 && o.chunk > 0; }
  static constexpr int kKvRingGroups = 2, kGradRingGroups = 3;
  static int64_t ChunkPages(const StateOptions& o) { return (o.chunk + o.page_size - 1) / o.page_size + 1; }
  // The logical pages a slot holds for chunk c: those it overlaps, and the one holding position c.begin even
  // when c is empty (the next chunk's first page, prefetched).
  static std::vector<uint8_t> ChunkPageMask(Chunk c, int64_t page_size);

  // The ring: Stream issues the fetch of one group's pages of `layer` that are not on the device (K/V; with
  // grad, gradient pages too: copied when home holds them, else new zeroed ones). Groups are streamed in order,
  // at most two ahead of the one computing: AwaitGroup makes the oldest streamed group's pages resident (waits
  // for its fetch), FinishGroup is called once it is computed (its K/V pages are freed; its gradient pages go
  // home and are freed once that write-back is done, at the next FinishGroup or FlushGroups). Pages already on the
  // device (the chunk's own) are left alone.
  void StreamGroup(int layer, const std::vector<int64_t>& pages, bool grad);
  void AwaitGroup();
  void FinishGroup();
  void FlushGroups();

  int64_t host_bytes() const { return host_bytes_; }
  bool resident(int layer) const { return FindSlot(layer) >= 0; }
  // Bytes copied so far, host to device and device to host.
  int64_t fetched_bytes() const { return fetched_bytes_; }
  int64_t written_back_bytes() const { return written_back_bytes_; }

 private:
  struct Home {  // K and V of every layer, [layers][rows_per_layer][row]
    char* k = nullptr;
    char* v = nullptr;
  };
  // A layer's pages are on the device where the pools' tables have them: a page made resident holds the rows
  // home had, and rows written since.
  struct Slot {
    int layer = -1;           // -1: free
    Chunk kv_dirty;           // K/V rows written on the device and not yet sent home
    bool grad_dirty = false;  // gradient pages on the device changed since they were last sent home
    int64_t last_use = 0;     // visit that last fetched into or used the slot, for least-recently-used eviction
    bool fetching = false, writing_back = false;  // copies issued and not yet waited for
  };

  // The slot holding access.layer with what the access reads, evicting the least recently used slot other than
  // `keep` when the layer is not resident, and (drop_unread) dropping its pages the access does not read. Copies
  // are issued, not waited for.
  Slot& Fetch(const LayerAccess& access, int keep, bool drop_unread);
  void WriteBack(Slot& s);
  // Frees the slot's pages the access does not read (sending home what changed first).
  void DropUnread(Slot& s, const LayerAccess& a);
  void Evict(Slot& s);
  void Wait(int lane);
  int FindSlot(int layer) const;
  // Copies rows [begin, end) of `layer` between its home and its pages in `pool`, one run per page.
  void CopyRows(PagePool& pool, const Home& home, int layer, int64_t begin, int64_t end, bool to_device);
  Home AllocHome();

  PagePool& kv_;
  PagePool* grad_;
  CopyEngine copies_;
  int64_t page_size_, rows_per_layer_, row_bytes_;
  Home kv_home_, grad_home_;
  std::vector<int64_t> home_kv_rows_;                  // per layer: K/V rows [0, n) are valid at home
  std::vector<std::vector<uint8_t>> home_grad_pages_;  // per layer and page: the gradient page is valid at home
  std::vector<Slot> slots_;
  struct Group {  // pages the ring brought to the device
    int layer = -1;
    std::vector<int64_t> kv, grad;
  };
  std::vector<Group> streamed_;  // streamed and not finished, oldest first
  Group written_;                // gradient pages of the last finished group, being written back
  int previous_ = -1;            // layer of the previous visit
  int64_t clock_ = 0;
  int64_t host_bytes_ = 0, fetched_bytes_ = 0, written_back_bytes_ = 0;
};

}  // namespace sg
