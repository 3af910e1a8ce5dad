// The CUDA backend's runtime: compute stream, errors and the record of ops in flight, the caching device-memory
// allocator and host copies, scratch, the copy engine for KV offload (pinned host memory, one stream per lane,
// ordered against the compute stream by events), device probe and memory info.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/memory.h"
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace sg::cuda {

namespace {
std::string ErrorText(const std::string& op, const char* what, cudaError_t e) {
  return op + ": " + what + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}
std::atomic<int> g_gemm_math{static_cast<int>(GemmMath::kF32)};

// SEQGRAD_CUDA_SYNC=1: wait after every op. Read again at every chunk's start, so a process can switch.
std::atomic<bool> g_sync_every_op{false};
void ReadSyncSetting() {
  const char* e = std::getenv("SEQGRAD_CUDA_SYNC");
  g_sync_every_op = e != nullptr && std::string(e) == "1";
}

// The ops issued to the compute stream since it was last seen idle, with the chunk each belongs to: what a fault
// found at a check is reported against.
class InFlight {
 public:
  void Add(const char* op) {
    std::lock_guard<std::mutex> l(mu_);
    if (ops_.size() == kMax) {  // keep the newest
      ops_.erase(ops_.begin(), ops_.begin() + kMax / 2);
      dropped_ += kMax / 2;
    }
    ops_.push_back({op, label_});
  }
  void Label(std::string label) {
    std::lock_guard<std::mutex> l(mu_);
    label_ = labels_.size();
    labels_.push_back(std::move(label));
  }
  std::string CurrentLabel() {
    std::lock_guard<std::mutex> l(mu_);
    return labels_.empty() ? std::string() : labels_[label_];
  }
  // The stream was idle: nothing is in flight.
  void Clear() {
    std::lock_guard<std::mutex> l(mu_);
    ops_.clear();
    dropped_ = 0;
    std::string current = labels_.empty() ? std::string() : labels_[label_];
    labels_.assign(1, std::move(current));
    label_ = 0;
  }
  // "chunk [0, 4): embedding_forward, gemm x3, ...; chunk [4, 8): ..." (ops in issue order, repeats counted), for
  // the last kChunksShown chunks: the device runs at most a queue's depth behind the host.
  std::string Describe() {
    std::lock_guard<std::mutex> l(mu_);
    if (ops_.empty()) return "none recorded";
    constexpr int kChunksShown = 4;
    size_t i = ops_.size();
    for (int shown = 0; i > 0 && shown < kChunksShown; ++shown) {
      const size_t label = ops_[i - 1].second;
      while (i > 0 && ops_[i - 1].second == label) --i;
    }
    std::string out = i + dropped_ > 0 ? std::to_string(i + dropped_) + " earlier ops not listed" : "";
    while (i < ops_.size()) {
      const size_t label = ops_[i].second;
      if (!out.empty()) out += "; ";
      out += labels_[label].empty() ? std::string("outside a chunk") : labels_[label];
      out += ":";
      std::vector<std::pair<const char*, int>> counts;  // first-seen order
      for (; i < ops_.size() && ops_[i].second == label; ++i) {
        auto it = std::find_if(counts.begin(), counts.end(),
                               [&](const auto& c) { return std::string(c.first) == ops_[i].first; });
        if (it == counts.end()) counts.push_back({ops_[i].first, 1});
        else ++it->second;
      }
      for (size_t k = 0; k < counts.size(); ++k)
        out += std::string(k ? ", " : " ") + counts[k].first +
               (counts[k].second > 1 ? " x" + std::to_string(counts[k].second) : "");
    }
    return out;
  }

 private:
  static constexpr size_t kMax = 1 << 16;
  std::mutex mu_;
  std::vector<std::pair<const char*, size_t>> ops_;
  std::vector<std::string> labels_;
  size_t label_ = 0;
  int64_t dropped_ = 0;
};
InFlight& Record() {
  static auto* r = new InFlight;
  return *r;
}

std::string WithChunk(const char* op) {
  const std::string label = Record().CurrentLabel();
  return label.empty() ? std::string(op) : std::string(op) + " (" + label + ")";
}

// A fault of asynchronous work found at `where`: the context is unusable on a GPU (a sticky error), so say which
// work it came from as well as we know.
[[noreturn]] void ThrowFault(const std::string& where, cudaError_t e) {
  throw CudaError(ErrorText(where, "the device's work", e) +
                  "; ops in flight since the last check, the failing one among them (SEQGRAD_CUDA_SYNC=1 stops at "
                  "it): " + Record().Describe());
}

// Waits for the compute stream; a fault of anything issued before is reported against the ops in flight.
void SynchronizeCompute(const std::string& where) {
  const cudaError_t e = cudaStreamSynchronize(Stream());
  if (e != cudaSuccess) ThrowFault(where, e);
  Record().Clear();
}
}  // namespace

void SetGemmMath(GemmMath math) { g_gemm_math = static_cast<int>(math); }
GemmMath GetGemmMath() { return static_cast<GemmMath>(g_gemm_math.load()); }

cudaStream_t Stream() {
  static cudaStream_t s = [] {
    ReadSyncSetting();
    cudaStream_t st = nullptr;
    Check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cuda runtime", "creating the compute stream");
    return st;
  }();
  return s;
}

void Check(cudaError_t e, const char* op, const char* what) {
  if (e == cudaSuccess) return;
  // A call's own error names the call; anything else is a fault of earlier work that this call found.
  const bool own = e == cudaErrorInvalidValue || e == cudaErrorInvalidConfiguration || e == cudaErrorMemoryAllocation ||
                   e == cudaErrorLaunchOutOfResources || e == cudaErrorInvalidDeviceFunction;
  if (own) throw CudaError(ErrorText(WithChunk(op), what, e));
  ThrowFault(WithChunk(op) + ": " + what, e);
}

void End(const char* op) {
  Check(cudaGetLastError(), op, "kernel launch");
  Record().Add(op);
  if (!g_sync_every_op.load(std::memory_order_relaxed)) return;
  const cudaError_t e = cudaStreamSynchronize(Stream());
  if (e != cudaSuccess) throw CudaError(ErrorText(WithChunk(op), "kernel (SEQGRAD_CUDA_SYNC=1: this op)", e));
  Record().Clear();
}

void Fetch(void* dst, const void* src, size_t bytes, const char* op) {
  End(op);
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, Stream()), op, "copying the results back");
  SynchronizeCompute(WithChunk(op));
}

namespace {

// Device memory: a caching allocator over cudaMalloc. A freed block goes back to a free list of its size class
// and the next allocation of that class takes it, without waiting: every kernel and copy that touches engine
// memory runs on the compute stream (the offload lanes are ordered against it by events), so the block's new use
// is ordered after its old one. A miss asks cudaMalloc for a new block, only if the device has it free (plus a
// margin for the runtime's own needs); otherwise the cached blocks are released first, and if that is not enough
// the allocation fails with out of memory (the engine's status: RESOURCE_EXHAUSTED; nothing is left half-done).
class Pool {
 public:
  void* Alloc(size_t bytes) {
    const size_t size = SizeClass(bytes);
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = free_.find(size);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        cached_ -= size;
        return p;
      }
    }
    if (void* p = NewBlock(size)) return p;
    ReleaseCached();
    if (void* p = NewBlock(size)) return p;
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    throw MemoryLimitExceeded("out of device memory: " + std::to_string(bytes) + " bytes asked, " +
                              std::to_string(free_bytes) + " of " + std::to_string(total) +
                              " free on the GPU (a margin of " + std::to_string(kMargin) +
                              " is left for the CUDA runtime; the engine's cached blocks were released first)");
  }
  void Free(void* p) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = size_of_.find(p);
    if (it == size_of_.end()) return;
    free_.emplace(it->second, p);
    cached_ += it->second;
  }
  // Waits for the compute stream and returns every cached block to the device.
  void ReleaseCached() {
    std::lock_guard<std::mutex> l(mu_);
    if (free_.empty()) return;
    cudaStreamSynchronize(Stream());  // a fault here shows at the next check
    for (const auto& [size, p] : free_) {
      cudaFree(p);
      size_of_.erase(p);
    }
    free_.clear();
    cached_ = 0;
  }
  size_t cached() {
    std::lock_guard<std::mutex> l(mu_);
    return cached_;
  }

 private:
  static constexpr size_t kMargin = size_t{64} << 20;
  // 512-byte units up to 1 MiB, then 8 classes per power of two (at most 12.5% rounding).
  static size_t SizeClass(size_t bytes) {
    if (bytes <= (size_t{1} << 20)) return std::max<size_t>(512, (bytes + 511) / 512 * 512);
    size_t top = size_t{1} << (63 - __builtin_clzll(bytes));
    const size_t unit = top / 8;
    return (bytes + unit - 1) / unit * unit;
  }
  void* NewBlock(size_t size) {
    size_t free_bytes = 0, total = 0;
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess || size + kMargin > free_bytes) {
      cudaGetLastError();
      return nullptr;
    }
    void* p = nullptr;
    if (cudaMalloc(&p, size) != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky
      return nullptr;
    }
    std::lock_guard<std::mutex> l(mu_);
    size_of_[p] = size;
    return p;
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> size_of_;
  size_t cached_ = 0;
};
Pool& DevicePool() {
  static auto* pool = new Pool;  // never destroyed: tensors may outlive static destruction
  return *pool;
}

void* PoolAlloc(size_t bytes) { return DevicePool().Alloc(bytes); }
void PoolFree(void* p) { DevicePool().Free(p); }
void PoolZero(void* p, size_t bytes) {
  Check(cudaMemsetAsync(p, 0, bytes, Stream()), "zero", "cudaMemsetAsync");
  End("zero");
}

// Host access: copies on the compute stream, after the work issued before them.
void CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, Stream());
  if (e != cudaSuccess) ThrowFault("copy to the host", e);
  SynchronizeCompute("copy to the host");
}
void CopyFromHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, Stream());
  if (e != cudaSuccess) ThrowFault("copy from the host", e);
  SynchronizeCompute("copy from the host");  // the host buffer may go once this returns
}
void CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, Stream()), "copy", "cudaMemcpyAsync");
  End("copy");
}

}  // namespace

void* Scratch(size_t bytes, int slot, const char* op) {
  struct Buffers {
    void* p[kNumSlots] = {};
    size_t size[kNumSlots] = {};
    ~Buffers() {
      for (void* q : p)
        if (q) PoolFree(q);
    }
  };
  thread_local Buffers b;
  if (b.size[slot] >= bytes && b.p[slot]) return b.p[slot];
  if (b.p[slot]) PoolFree(b.p[slot]);
  b.p[slot] = nullptr;
  b.size[slot] = 0;
  const size_t grown = bytes + bytes / 2 + 256;
  try {
    b.p[slot] = PoolAlloc(grown);
  } catch (const MemoryLimitExceeded& e) {
    throw MemoryLimitExceeded(std::string(op) + ": device scratch: " + e.what());
  }
  b.size[slot] = grown;
  return b.p[slot];
}

namespace {

// KV offload's copy engine: lane streams beside the compute stream. A copy waits for the compute work issued
// before it (it may read what kernels wrote, or overwrite pages they read); wait(lane) makes later compute work
// wait for the lane's copies. Neither blocks the host; freeing the pinned memory does.
constexpr int kLanes = 4;
struct Lanes {
  cudaStream_t stream[kLanes] = {};
  cudaEvent_t done[kLanes] = {};    // recorded on the lane by wait()
  cudaEvent_t compute = nullptr;    // recorded on the compute stream before a lane's copy
};
Lanes& TheLanes() {
  static Lanes* lanes = [] {
    auto* l = new Lanes;
    for (int i = 0; i < kLanes; ++i) {
      Check(cudaStreamCreateWithFlags(&l->stream[i], cudaStreamNonBlocking), "offload", "creating a copy stream");
      Check(cudaEventCreateWithFlags(&l->done[i], cudaEventDisableTiming), "offload", "creating an event");
    }
    Check(cudaEventCreateWithFlags(&l->compute, cudaEventDisableTiming), "offload", "creating an event");
    return l;
  }();
  return *lanes;
}
cudaStream_t LaneStream(int lane) {
  if (lane < 0 || lane >= kLanes) throw CudaError("offload: copy lane out of range");
  return TheLanes().stream[lane];
}
void* PinnedAlloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMallocHost(&p, bytes == 0 ? 64 : bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw MemoryLimitExceeded(ErrorText("offload", "cudaMallocHost (pinned host memory)", e) + " for " +
                              std::to_string(bytes) + " bytes");
  }
  return p;
}
void PinnedFree(void* p) {
  for (int i = 0; i < kLanes; ++i) cudaStreamSynchronize(LaneStream(i));  // no copy may still use it
  cudaFreeHost(p);
}
void LaneCopy(void* dst, const void* src, size_t bytes, int lane) {
  Lanes& l = TheLanes();
  const cudaStream_t s = LaneStream(lane);
  Check(cudaEventRecord(l.compute, Stream()), "offload", "cudaEventRecord");
  Check(cudaStreamWaitEvent(s, l.compute, 0), "offload", "cudaStreamWaitEvent");
  Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "offload", "cudaMemcpyAsync");
  if (g_sync_every_op.load(std::memory_order_relaxed)) Check(cudaStreamSynchronize(s), "offload", "copy");
}
void LaneWait(int lane) {
  Lanes& l = TheLanes();
  Check(cudaEventRecord(l.done[lane], LaneStream(lane)), "offload", "cudaEventRecord");
  Check(cudaStreamWaitEvent(Stream(), l.done[lane], 0), "offload", "cudaStreamWaitEvent");
}

}  // namespace

std::string Probe() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(e);
  }
  if (count == 0) return "no CUDA device on this machine";
  return "";
}

namespace {
std::string SetMatmul(const std::string& mode) {
  if (mode == "fp32") SetGemmMath(GemmMath::kF32);
  else if (mode == "tf32") SetGemmMath(GemmMath::kTF32);
  else if (mode == "bf16") SetGemmMath(GemmMath::kBF16);
  else return "unknown matmul mode '" + mode + "' (choose fp32, tf32 or bf16)";
  return "";
}

cudaDeviceProp Properties() {
  int device = 0;
  Check(cudaGetDevice(&device), "device info", "cudaGetDevice");
  cudaDeviceProp p{};
  Check(cudaGetDeviceProperties(&p, device), "device info", "cudaGetDeviceProperties");
  return p;
}

// Dense FLOP per clock per SM (an FMA counts 2) of the tensor cores / FP units, by architecture: Hopper (sm_90)
// and Ampere datacenter (sm_80). Other GPUs: 0 (MFU not reported).
double PeakFlops(bool f64) {
  const cudaDeviceProp p = Properties();
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  double per_sm = 0;
  const GemmMath math = GetGemmMath();
  if (p.major == 9) per_sm = f64 ? 128 : math == GemmMath::kBF16 ? 4096 : math == GemmMath::kTF32 ? 2048 : 256;
  if (p.major == 8 && p.minor == 0) per_sm = f64 ? 64 : math == GemmMath::kBF16 ? 2048 : math == GemmMath::kTF32 ? 1024 : 128;
  return per_sm * p.multiProcessorCount * clock_khz * 1e3;
}
}  // namespace

void RegisterRuntime(DeviceBackend& b) {
  b.set_matmul = SetMatmul;
  b.name = [] { return std::string(Properties().name); };
  b.peak_flops = PeakFlops;
  b.probe = Probe;
  b.memory_info = [](int64_t* free_bytes, int64_t* total_bytes) {
    size_t f = 0, t = 0;
    Check(cudaMemGetInfo(&f, &t), "memory info", "cudaMemGetInfo");
    *free_bytes = static_cast<int64_t>(f + DevicePool().cached());  // the engine's cached blocks are its to use
    *total_bytes = static_cast<int64_t>(t);
  };
  b.synchronize = [] {
    SynchronizeCompute("end of step");
    Check(cudaDeviceSynchronize(), "end of step", "cudaDeviceSynchronize");  // the copy lanes too
  };
  b.begin_chunk = [](const std::string& label) {
    ReadSyncSetting();
    const cudaError_t e = cudaStreamQuery(Stream());  // does not wait
    if (e == cudaSuccess) Record().Clear();
    else if (e != cudaErrorNotReady) ThrowFault("start of " + label, e);
    Record().Label(label);
  };
  b.copies.alloc_host = PinnedAlloc;
  b.copies.free_host = PinnedFree;
  b.copies.copy_async = LaneCopy;
  b.copies.wait = LaneWait;
  DeviceAllocator a;
  a.alloc = PoolAlloc;
  a.free = PoolFree;
  a.memset_zero = PoolZero;
  a.to_host = CopyToHost;
  a.from_host = CopyFromHost;
  a.on_device = CopyOnDevice;
  RegisterDeviceAllocator(Device::kCUDA, a);
}

}  // namespace sg::cuda
