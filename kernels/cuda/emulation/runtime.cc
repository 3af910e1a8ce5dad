// The CPU emulation's device runtime: launches (blocks in order, threads as cooperative fibers), barriers, warp
// exchanges, the CUDA runtime API on host memory, and a cuBLAS GEMM. See include/sg_emu.h for the model.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "base/dtype.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define SG_EMU_ASAN 1
#endif
#include "cublas_v2.h"
#include "cuda_runtime.h"

// ---------------------------------------------------------------------------------------------------------------
// Context switch (x86-64 System V): saves the callee-saved registers, MXCSR and the x87 control word on the current
// stack, stores the stack pointer in *save, and continues on `next` (a stack saved the same way, or a new fiber's
// initial frame whose return address is the trampoline).

extern "C" void sg_emu_switch(void** save, void* next);
extern "C" void sg_emu_trampoline();

#if defined(__x86_64__)
asm(R"(
  .text
  .globl sg_emu_switch
  .type sg_emu_switch,@function
sg_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sg_emu_switch,.-sg_emu_switch

  .globl sg_emu_trampoline
  .type sg_emu_trampoline,@function
sg_emu_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size sg_emu_trampoline,.-sg_emu_trampoline
)");
#else
#error "the CUDA emulation's context switch is written for x86-64"
#endif

namespace sg_emu {
namespace {

constexpr size_t kStackBytes = 512 * 1024;  // per fiber (mapped lazily), plus a guard page
constexpr size_t kSmemGuard = 256;          // bytes after the dynamic shared memory, checked after each block
constexpr unsigned char kSmemFill = 0xff;   // NaN as float/double
constexpr unsigned char kGuardFill = 0xa5;
constexpr size_t kDefaultSmem = 48 * 1024;           // without cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr size_t kOptinSmem = 227 * 1024;            // H100: sharedMemPerBlockOptin
constexpr int kMaxThreads = 1024;

struct Fiber {
  void* sp = nullptr;
  char* mapping = nullptr;
  void* fake_stack = nullptr;  // ASan
  int tid = -1;
  bool idle = true;
  ~Fiber() {
    if (mapping) munmap(mapping, kStackBytes + static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  }
};

struct Warp {
  int lanes = 0;              // threads of the block in this warp
  unsigned exist = 0;         // bit per existing lane
  unsigned done = 0;          // lanes that exited
  unsigned gen = 0;           // completed exchanges
  unsigned need[2] = {0, 0};  // lanes the current exchange waits for (union of the masks given)
  unsigned arrived[2] = {0, 0};
  unsigned char slot[2][32][8];
  std::vector<Fiber*> waiters;
};

struct Block {
  int n = 0;     // threads
  int next = 0;  // first thread not started
  int done = 0;
  int bar_waiting = 0;
  int bar_count = 0;   // predicates of the barrier in progress
  int bar_result = 0;  // of the last completed barrier
  std::vector<Fiber*> bar_waiters;
  std::vector<Warp> warps;
  std::deque<Fiber*> runq[32];  // runnable fibers per warp
  uint32_t runnable = 0;         // warps with runnable fibers
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  bool reverse = false;  // threads started from the highest index (SG_EMU_ORDER=reverse)
  std::vector<const void*> shared_seen;  // static __shared__ variables filled for this block
};

// SG_EMU_ORDER=reverse runs blocks and starts threads from the highest index down (barrier waiters resume in
// arrival order either way): a kernel that depends on the emulator's default order (a missing __syncthreads, a
// block reading another block's output) then gives different results.
bool ReverseOrder() {
  static const bool reverse = [] {
    const char* e = std::getenv("SG_EMU_ORDER");
    return e != nullptr && std::string(e) == "reverse";
  }();
  return reverse;
}

struct HostThread {
  void* sched_sp = nullptr;
  Fiber* current = nullptr;
  Block* block = nullptr;
  const LaunchInfo* launch = nullptr;
  unsigned char* smem = nullptr;
  std::vector<Fiber*> fibers;  // all, idle or not
  const void* sched_bottom = nullptr;  // the host thread's own stack (ASan)
  size_t sched_size = 0;
  void* sched_fake_stack = nullptr;
  std::string error;           // first error of the launch in progress
  cudaError_t last_error = cudaSuccess;
  std::string last_error_text;
  ~HostThread() {
    for (Fiber* f : fibers) delete f;  // all idle between launches
  }
};
thread_local HostThread ht;

void SetIndex(int tid) {
  const unsigned bx = blockDim.x, by = blockDim.y;
  threadIdx.x = tid % bx;
  threadIdx.y = (tid / bx) % by;
  threadIdx.z = tid / (bx * by);
}

void Fail(const std::string& what) {
  if (ht.error.empty()) {
    ht.error = what;
    if (ht.launch)
      ht.error += std::string(" [kernel ") + ht.launch->kernel + " launched at " + ht.launch->where + ", block (" +
                  std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) +
                  ")]";
  }
}

std::string ThreadName() {
  return "thread (" + std::to_string(threadIdx.x) + "," + std::to_string(threadIdx.y) + "," +
         std::to_string(threadIdx.z) + ")";
}

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// Fiber -> scheduler.
void Yield(Fiber* f) {
#ifdef SG_EMU_ASAN
  __sanitizer_start_switch_fiber(&f->fake_stack, ht.sched_bottom, ht.sched_size);
#endif
  sg_emu_switch(&f->sp, ht.sched_sp);
#ifdef SG_EMU_ASAN
  __sanitizer_finish_switch_fiber(f->fake_stack, &ht.sched_bottom, &ht.sched_size);
#endif
}

void MakeRunnable(Block* b, Fiber* f) {
  const int w = f->tid / 32;
  b->runq[w].push_back(f);
  b->runnable |= 1u << w;
}

void ReleaseBlockBarrier(Block* b) {
  b->bar_result = b->bar_count;
  b->bar_count = 0;
  b->bar_waiting = 0;
  for (Fiber* f : b->bar_waiters) MakeRunnable(b, f);
  b->bar_waiters.clear();
}


void ReleaseWarp(Block* b, Warp& w) {
  const unsigned g = w.gen;
  const unsigned missing = w.need[g & 1] & w.exist & ~w.arrived[g & 1];
  if (missing) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%08x", missing);
    Fail(std::string("warp shuffle/vote/__syncwarp: the mask names lanes that exited before taking part (lanes 0x") +
         buf + " of warp " + std::to_string(&w - b->warps.data()) + ")");
  }
  ++w.gen;
  w.need[(g + 1) & 1] = 0;
  w.arrived[(g + 1) & 1] = 0;
  for (Fiber* f : w.waiters) MakeRunnable(b, f);
  w.waiters.clear();
}

bool WarpComplete(const Warp& w) {
  const unsigned g = w.gen & 1;
  const unsigned need = w.need[g] & w.exist;
  return w.arrived[g] != 0 && ((w.arrived[g] | w.done) & need) == need;
}

void ThreadExit(Block* b, int tid) {
  ++b->done;
  Warp& w = b->warps[tid / 32];
  w.done |= 1u << (tid % 32);
  if (b->bar_waiting > 0 && b->bar_waiting == b->n - b->done) ReleaseBlockBarrier(b);
  if (!w.waiters.empty() && WarpComplete(w)) ReleaseWarp(b, w);
}

void FiberMain(Fiber* f) {
#ifdef SG_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &ht.sched_bottom, &ht.sched_size);
#endif
  for (;;) {
    Block* b = ht.block;
    while (b->next < b->n) {
      const int k = b->next++;
      const int tid = b->reverse ? b->n - 1 - k : k;
      f->tid = tid;
      SetIndex(tid);
      b->body(b->ctx);
      ThreadExit(b, tid);
      if (b->runnable) break;  // let the scheduler choose (warps in order)
    }
    f->idle = true;
    f->tid = -1;
    Yield(f);
  }
}

Fiber* NewFiber() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) {
    std::fprintf(stderr, "sg_emu: cannot map a fiber stack\n");
    std::abort();
  }
  mprotect(m, page, PROT_NONE);  // overflow guard
  auto* f = new Fiber;
  f->mapping = static_cast<char*>(m);
  // Initial frame, as sg_emu_switch leaves one: [mxcsr, fpucw][r15][r14][r13][r12][rbx][rbp][ret], ret in the
  // top slot: after `ret` the stack pointer is 16-byte aligned, as the trampoline's call needs.
  auto top = reinterpret_cast<uintptr_t>(f->mapping + page + kStackBytes);
  top &= ~uintptr_t{15};
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = reinterpret_cast<uint64_t>(&sg_emu_trampoline);     // ret
  *--sp = 0;                                                  // rbp
  *--sp = 0;                                                  // rbx
  *--sp = reinterpret_cast<uint64_t>(f);                      // r12: argument
  *--sp = reinterpret_cast<uint64_t>(&FiberMain);             // r13: entry
  *--sp = 0;                                                  // r14
  *--sp = 0;                                                  // r15
  uint32_t mxcsr = 0x1f80;
  uint16_t fpucw = 0x037f;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  uint64_t ctl = static_cast<uint64_t>(mxcsr) | static_cast<uint64_t>(fpucw) << 32;
  *--sp = ctl;
  f->sp = sp;
  ht.fibers.push_back(f);
  return f;
}

void DestroyFiber(Fiber* f) { delete f; }

Fiber* IdleFiber() {
  for (Fiber* f : ht.fibers)
    if (f->idle) return f;
  return NewFiber();
}

void Resume(Fiber* f) {
  ht.current = f;
  if (f->tid >= 0) SetIndex(f->tid);
#ifdef SG_EMU_ASAN
  __sanitizer_start_switch_fiber(&ht.sched_fake_stack, f->mapping + PageSize(), kStackBytes);
#endif
  sg_emu_switch(&ht.sched_sp, f->sp);
#ifdef SG_EMU_ASAN
  __sanitizer_finish_switch_fiber(ht.sched_fake_stack, nullptr, nullptr);
#endif
  ht.current = nullptr;
}

// Runs every thread of the current block to completion (or to a deadlock).
void RunBlock(Block* b) {
  for (;;) {
    // Warp-greedy order: the lowest warp (highest when reversed) that can run goes on until all its threads wait
    // at a block barrier or exit, so that a missing __syncthreads between warps shows.
    int rw = -1;
    if (b->runnable) rw = b->reverse ? 31 - __builtin_clz(b->runnable) : __builtin_ctz(b->runnable);
    if (rw >= 0 && b->next < b->n) {
      const int uw = (b->reverse ? b->n - 1 - b->next : b->next) / 32;  // warp of the next thread to start
      if (b->reverse ? uw > rw : uw < rw) rw = -1;
    }
    if (rw >= 0) {
      Fiber* f = b->runq[rw].front();
      b->runq[rw].pop_front();
      if (b->runq[rw].empty()) b->runnable &= ~(1u << rw);
      Resume(f);
      continue;
    }
    if (b->next < b->n) {
      Fiber* f = IdleFiber();
      f->idle = false;
      Resume(f);
      continue;
    }
    break;
  }
  if (b->done == b->n) return;
  // Threads left waiting: at a __syncthreads that others never reach, or at a warp exchange.
  std::string what = "deadlock: " + std::to_string(b->n - b->done) + " of " + std::to_string(b->n) +
                     " threads wait forever (" + std::to_string(b->bar_waiting) + " at __syncthreads";
  int at_warp = 0;
  for (const Warp& w : b->warps) at_warp += static_cast<int>(w.waiters.size());
  what += ", " + std::to_string(at_warp) + " at a warp shuffle/vote/__syncwarp)";
  Fail(what);
  // The stuck fibers can never run again: drop them.
  std::vector<Fiber*> keep;
  for (Fiber* f : ht.fibers) {
    if (f->idle) keep.push_back(f);
    else DestroyFiber(f);
  }
  ht.fibers = keep;
}

Fiber* Current(const char* what) {
  if (!ht.current || !ht.block) {
    std::fprintf(stderr, "sg_emu: %s called outside an emulated kernel\n", what);
    std::abort();
  }
  return ht.current;
}


}  // namespace

int LinearThread() {
  return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

int SyncThreads(int pred) {
  Fiber* f = Current("__syncthreads");
  Block* b = ht.block;
  if (pred) ++b->bar_count;
  ++b->bar_waiting;
  // The last to arrive waits too: the scheduler picks who runs first after the barrier.
  b->bar_waiters.push_back(f);
  if (b->bar_waiting == b->n - b->done) ReleaseBlockBarrier(b);
  Yield(f);
  return b->bar_result;
}

const void* WarpExchange(unsigned mask, const void* value, size_t bytes, int src, const char* what) {
  Fiber* f = Current(what);
  Block* b = ht.block;
  const int tid = f->tid, lane = tid % 32;
  Warp& w = b->warps[tid / 32];
  const unsigned g = w.gen & 1;
  if (!(mask >> lane & 1u))
    Fail(std::string(what) + ": the calling lane " + std::to_string(lane) + " is not in the mask (" + ThreadName() +
         ")");
  if (mask & ~w.exist)
    Fail(std::string(what) + ": mask 0x" + [&] {
      char buf[16];
      std::snprintf(buf, sizeof buf, "%08x", mask);
      return std::string(buf);
    }() + " names lanes that do not exist (the block has " + std::to_string(b->n) + " threads)");
  if (mask & w.done)
    Fail(std::string(what) + ": the mask names lanes that have already exited (lanes 0x" + [&] {
      char buf[16];
      std::snprintf(buf, sizeof buf, "%08x", mask & w.done);
      return std::string(buf);
    }() + ", " + ThreadName() + ")");
  std::memcpy(w.slot[g][lane], value, bytes);
  w.arrived[g] |= 1u << lane;
  w.need[g] |= mask;
  if (WarpComplete(w)) {
    ReleaseWarp(b, w);
  } else {
    w.waiters.push_back(f);
    Yield(f);
  }
  if (src < 0) return nullptr;
  if (!(w.arrived[g] >> src & 1u)) {
    Fail(std::string(what) + ": lane " + std::to_string(lane) + " reads lane " + std::to_string(src) +
         ", which did not take part (" + ThreadName() + ")");
    return w.slot[g][lane];
  }
  return w.slot[g][src];
}

unsigned WarpBallot(unsigned mask, int pred, const char* what) {
  Fiber* f = Current(what);
  Warp& w = ht.block->warps[f->tid / 32];
  const unsigned g = w.gen & 1;
  const int p = pred != 0;
  WarpExchange(mask, &p, sizeof p, -1, what);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) {
    if (!(w.arrived[g] >> l & 1u) || !(mask >> l & 1u)) continue;
    int v;
    std::memcpy(&v, w.slot[g][l], sizeof v);
    if (v) bits |= 1u << l;
  }
  return bits;
}

void StaticShared(void* p, size_t bytes) {
  Current("__shared__");
  Block* b = ht.block;
  for (const void* q : b->shared_seen)
    if (q == p) return;
  b->shared_seen.push_back(p);
  std::memset(p, kSmemFill, bytes);
}

void* DynamicShared() {
  Current("extern __shared__");
  return ht.smem;
}

void DeviceError(const char* what) { Fail(what); }

namespace {
std::mutex g_attr_mu;
std::map<const void*, int>& SmemLimits() {
  static auto* m = new std::map<const void*, int>;
  return *m;
}

void SetLastError(cudaError_t e, const std::string& text) {
  if (ht.last_error == cudaSuccess) {
    ht.last_error = e;
    ht.last_error_text = text;
  }
}

// An error of a kernel's execution: reported (once) by the next synchronizing call of any host thread, as a GPU
// reports a fault of asynchronous work, not by cudaGetLastError right after the launch.
std::mutex g_execution_mu;
cudaError_t g_execution_error = cudaSuccess;
std::string g_execution_text;
void SetExecutionError(cudaError_t e, const std::string& text) {
  std::lock_guard<std::mutex> l(g_execution_mu);
  if (g_execution_error != cudaSuccess) return;
  g_execution_error = e;
  g_execution_text = text;
}

// InjectKernelError's pending request.
std::mutex g_inject_mu;
std::string g_inject_kernel;
int g_inject_skip = -1;  // launches of the kernel to let pass first; -1: none pending
bool TakeInjected(const char* kernel) {
  std::lock_guard<std::mutex> l(g_inject_mu);
  if (g_inject_skip < 0 || std::string(kernel).find(g_inject_kernel) == std::string::npos) return false;
  return g_inject_skip-- == 0;
}
}  // namespace

void InjectKernelError(const std::string& kernel, int skip) {
  std::lock_guard<std::mutex> l(g_inject_mu);
  g_inject_kernel = kernel;
  g_inject_skip = skip;
}

std::pair<cudaError_t, std::string> TakeExecutionError() {
  std::lock_guard<std::mutex> l(g_execution_mu);
  std::pair<cudaError_t, std::string> e{g_execution_error, g_execution_text};
  g_execution_error = cudaSuccess;
  g_execution_text.clear();
  return e;
}

// ---------------------------------------------------------------------------------------------------------------
// Device memory: one reserved range of address space, PROT_NONE to host code except while something the device
// does runs (a launch, a copy, a memset, a cuBLAS call): a host access of device memory outside those faults,
// and the handler below names it. Blocks are handed out first-fit in 256-byte units.

namespace {
constexpr size_t kDeviceAlign = 256;

size_t DeviceCapacity() {
  if (const char* e = std::getenv("SG_EMU_DEVICE_MEMORY")) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(e, &end, 10);
    if (end != e && *end == '\0' && v > 0) return static_cast<size_t>(v);
    std::fprintf(stderr, "sg_emu: SG_EMU_DEVICE_MEMORY='%s' is not a byte count\n", e);
    std::abort();
  }
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
  return pages > 0 && size > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(size) : size_t{1} << 34;
}

// Protection changes in units of transparent huge pages (the arena asks for them): the cost of mprotect grows
// with the page-table entries it changes, 512 times fewer so.
constexpr size_t kHugePage = size_t{2} << 20;
size_t PageUp(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

struct Arena {
  char* base = nullptr;
  size_t capacity = 0;
  size_t used = 0;     // bytes in blocks handed out
  size_t mapped = 0;   // [base, base + mapped) has been handed out at some point (what opening must unprotect)
  std::map<size_t, size_t> free_blocks;  // offset -> bytes
  std::map<size_t, size_t> blocks;       // offset -> bytes, handed out
  int open = 0;                          // DeviceAccess nesting over all host threads
  std::mutex mu;
};

void OnSegv(int sig, siginfo_t* info, void* ctx);
struct sigaction g_previous_segv;

Arena& TheArena() {
  static Arena* a = [] {
    auto* arena = new Arena;
    arena->capacity = PageUp(DeviceCapacity());
    void* m = mmap(nullptr, arena->capacity + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "sg_emu: cannot reserve %zu bytes of address space for device memory\n", arena->capacity);
      std::abort();
    }
    arena->base = reinterpret_cast<char*>(PageUp(reinterpret_cast<uintptr_t>(m)));  // huge-page aligned
    madvise(arena->base, arena->capacity, MADV_HUGEPAGE);  // where the kernel allows it
    arena->free_blocks[0] = arena->capacity;
    struct sigaction sa {};
    sa.sa_sigaction = OnSegv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    return arena;
  }();
  return *a;
}


void OnSegv(int sig, siginfo_t* info, void* ctx) {
  Arena& a = TheArena();
  const char* at = static_cast<const char*>(info->si_addr);
  if (at >= a.base && at < a.base + a.capacity && a.open == 0) {
    char msg[256];
    const int n = std::snprintf(msg, sizeof msg,
                                "sg_emu: host code accessed emulated device memory at %p (offset %zu of the device's "
                                "memory) outside a kernel or cudaMemcpy*: device memory is not host-addressable\n",
                                static_cast<const void*>(at), static_cast<size_t>(at - a.base));
    if (n > 0) (void)!write(2, msg, static_cast<size_t>(n));
  }
  // Let the previous handler (or the default action) take the fault: restore it and return to re-fault.
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
  (void)sig;
  (void)ctx;
}

}  // namespace

size_t DeviceMemoryCapacity() { return TheArena().capacity; }
size_t DeviceMemoryUsed() {
  Arena& a = TheArena();
  std::lock_guard<std::mutex> l(a.mu);
  return a.used;
}

void* DeviceAlloc(size_t bytes) {
  Arena& a = TheArena();
  const size_t size = (std::max<size_t>(bytes, 1) + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign;
  std::lock_guard<std::mutex> l(a.mu);
  for (auto it = a.free_blocks.begin(); it != a.free_blocks.end(); ++it) {
    if (it->second < size) continue;
    const size_t offset = it->first, left = it->second - size;
    a.free_blocks.erase(it);
    if (left > 0) a.free_blocks[offset + size] = left;
    a.blocks[offset] = size;
    a.used += size;
    if (offset + size > a.mapped) {
      const size_t old = PageUp(a.mapped), now = PageUp(offset + size);
      if (a.open > 0 && now > old) mprotect(a.base + old, now - old, PROT_READ | PROT_WRITE);
      a.mapped = offset + size;
    }
    return a.base + offset;
  }
  return nullptr;
}

bool IsDeviceMemory(const void* p) {
  Arena& a = TheArena();
  return p >= a.base && p < a.base + a.capacity;
}

bool DeviceFree(void* p) {
  Arena& a = TheArena();
  std::lock_guard<std::mutex> l(a.mu);
  auto it = a.blocks.find(static_cast<size_t>(static_cast<char*>(p) - a.base));
  if (!IsDeviceMemory(p) || it == a.blocks.end()) return false;
  size_t offset = it->first, size = it->second;
  a.blocks.erase(it);
  a.used -= size;
  auto next = a.free_blocks.lower_bound(offset);
  if (next != a.free_blocks.end() && next->first == offset + size) {
    size += next->second;
    next = a.free_blocks.erase(next);
  }
  if (next != a.free_blocks.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      a.free_blocks.erase(prev);
    }
  }
  a.free_blocks[offset] = size;
  // Give the free pages back and lower the high-water mark: what opening and closing must reprotect (their cost
  // grows with the pages populated).
  const size_t first = PageUp(offset), last = (offset + size) / kHugePage * kHugePage;
  if (last > first) madvise(a.base + first, last - first, MADV_DONTNEED);
  const size_t high = a.blocks.empty() ? 0 : a.blocks.rbegin()->first + a.blocks.rbegin()->second;
  if (high < a.mapped) {
    if (a.open > 0 && PageUp(high) < PageUp(a.mapped))
      mprotect(a.base + PageUp(high), PageUp(a.mapped) - PageUp(high), PROT_NONE);
    a.mapped = high;
  }
  return true;
}

DeviceAccess::DeviceAccess() {
  Arena& a = TheArena();
  std::lock_guard<std::mutex> l(a.mu);
  if (a.open++ == 0 && a.mapped > 0) mprotect(a.base, PageUp(a.mapped), PROT_READ | PROT_WRITE);
}
DeviceAccess::~DeviceAccess() {
  Arena& a = TheArena();
  std::lock_guard<std::mutex> l(a.mu);
  if (--a.open == 0 && a.mapped > 0) mprotect(a.base, PageUp(a.mapped), PROT_NONE);
}

cudaError_t FuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value) {
  if (!fn) return cudaErrorInvalidDeviceFunction;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > kOptinSmem) {
      SetLastError(cudaErrorInvalidValue, "cudaFuncSetAttribute: MaxDynamicSharedMemorySize " +
                                              std::to_string(value) + " exceeds the device's " +
                                              std::to_string(kOptinSmem) + " bytes");
      return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> l(g_attr_mu);
    SmemLimits()[fn] = value;
  }
  return cudaSuccess;
}

// Async copies into host memory land at the next synchronization, or before the next device work, whichever comes
// first: a GPU's copy into pageable memory may return before its bytes are there, so host code that reads them
// before synchronizing reads stale bytes here too. The source is read when the copy is issued (stream order).
struct PendingHostWrites {
  std::mutex mu;
  std::vector<std::pair<void*, std::vector<char>>> writes;
};
PendingHostWrites& Pending() {
  static auto* p = new PendingHostWrites;
  return *p;
}
void LandHostWrites() {
  PendingHostWrites& p = Pending();
  std::lock_guard<std::mutex> lock(p.mu);
  for (auto& [dst, bytes] : p.writes) std::memcpy(dst, bytes.data(), bytes.size());
  p.writes.clear();
}

cudaError_t LaunchImpl(const LaunchInfo& info, void (*thread_body)(void*), void* ctx) {
  sg_emu::LandHostWrites();
  const std::string where = std::string(" [kernel ") + info.kernel + " launched at " + info.where + "]";
  const dim3 g = info.grid, bl = info.block;
  const unsigned long long threads = 1ull * bl.x * bl.y * bl.z;
  if (ht.block) {
    std::fprintf(stderr, "sg_emu: a kernel launch from device code%s\n", where.c_str());
    std::abort();
  }
  if (bl.x == 0 || bl.y == 0 || bl.z == 0 || bl.x > 1024 || bl.y > 1024 || bl.z > 64 || threads > kMaxThreads ||
      g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    SetLastError(cudaErrorInvalidConfiguration,
                 "invalid launch configuration: grid (" + std::to_string(g.x) + "," + std::to_string(g.y) + "," +
                     std::to_string(g.z) + "), block (" + std::to_string(bl.x) + "," + std::to_string(bl.y) + "," +
                     std::to_string(bl.z) + ")" + where);
    return cudaErrorInvalidConfiguration;
  }
  if (info.max_threads > 0 && threads > static_cast<unsigned long long>(info.max_threads)) {
    SetLastError(cudaErrorLaunchOutOfResources, "block of " + std::to_string(threads) +
                                                    " threads exceeds __launch_bounds__(" +
                                                    std::to_string(info.max_threads) + ")" + where);
    return cudaErrorLaunchOutOfResources;
  }
  size_t limit = kDefaultSmem;
  {
    std::lock_guard<std::mutex> l(g_attr_mu);
    auto it = SmemLimits().find(info.fn);
    if (it != SmemLimits().end()) limit = std::max(limit, static_cast<size_t>(it->second));
  }
  if (info.smem > limit) {
    SetLastError(cudaErrorInvalidValue, "dynamic shared memory of " + std::to_string(info.smem) +
                                            " bytes exceeds the kernel's limit of " + std::to_string(limit) +
                                            " (cudaFuncAttributeMaxDynamicSharedMemorySize)" + where);
    return cudaErrorInvalidValue;
  }

  DeviceAccess access;  // the kernel may touch device memory
  std::vector<unsigned char> smem(info.smem + kSmemGuard + 16);
  unsigned char* base = smem.data();
  base += (16 - reinterpret_cast<uintptr_t>(base) % 16) % 16;
  ht.smem = base;
  ht.launch = &info;
  ht.error.clear();
  gridDim = g;
  blockDim = bl;
  Block b;
  const bool reverse = ReverseOrder();
  for (unsigned zz = 0; zz < g.z && ht.error.empty(); ++zz)
    for (unsigned yy = 0; yy < g.y && ht.error.empty(); ++yy)
      for (unsigned xx = 0; xx < g.x && ht.error.empty(); ++xx) {
        const unsigned x = reverse ? g.x - 1 - xx : xx, y = reverse ? g.y - 1 - yy : yy,
                       z = reverse ? g.z - 1 - zz : zz;
        blockIdx = uint3{x, y, z};
        b.reverse = reverse;
        b.n = static_cast<int>(threads);
        b.next = b.done = b.bar_waiting = b.bar_count = b.bar_result = 0;
        b.bar_waiters.clear();
        for (auto& q : b.runq) q.clear();
        b.shared_seen.clear();
        b.runnable = 0;
        b.body = thread_body;
        b.ctx = ctx;
        const int nw = (b.n + 31) / 32;
        b.warps.assign(nw, Warp());
        for (int i = 0; i < nw; ++i) {
          Warp& w = b.warps[i];
          w.lanes = std::min(32, b.n - 32 * i);
          w.exist = w.lanes == 32 ? 0xffffffffu : (1u << w.lanes) - 1;
        }
        std::memset(base, kSmemFill, info.smem);
        std::memset(base + info.smem, kGuardFill, kSmemGuard);
        ht.block = &b;
        RunBlock(&b);
        ht.block = nullptr;
        for (size_t i = 0; i < kSmemGuard; ++i)
          if (base[info.smem + i] != kGuardFill) {
            Fail("write past the end of dynamic shared memory (" + std::to_string(info.smem) + " bytes) at byte " +
                 std::to_string(info.smem + i));
            break;
          }
      }
  ht.smem = nullptr;
  ht.launch = nullptr;
  threadIdx = uint3{0, 0, 0};
  blockIdx = uint3{0, 0, 0};
  if (ht.error.empty() && TakeInjected(info.kernel))
    ht.error = std::string("injected kernel error (sg_emu::InjectKernelError)") + where;
  if (!ht.error.empty()) {
    // The kernel ran (as far as it could): like a GPU, the launch itself succeeded and the fault shows at the
    // next synchronization.
    std::fprintf(stderr, "sg_emu: %s\n", ht.error.c_str());
    SetExecutionError(cudaErrorLaunchFailure, ht.error);
    ht.error.clear();
  }
  return cudaSuccess;
}

}  // namespace sg_emu

// ---------------------------------------------------------------------------------------------------------------
// Runtime API

using sg_emu::ht;

namespace {
const char* Name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}
const char* Text(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}
// Details of the most recent emulation error, returned by cudaGetErrorString for its code.
thread_local std::string g_detail;
thread_local cudaError_t g_detail_code = cudaSuccess;

cudaError_t TakeError(bool clear) {
  const cudaError_t e = ht.last_error;
  if (e != cudaSuccess) {
    g_detail = std::string(Text(e)) + " (CUDA emulation: " + ht.last_error_text + ")";
    g_detail_code = e;
  }
  if (clear) {
    ht.last_error = cudaSuccess;
    ht.last_error_text.clear();
  }
  return e;
}

struct CUstream_fake {
  unsigned flags;
};

void* AlignedAlloc(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  return std::aligned_alloc(256, rounded);
}
}  // namespace

cudaError_t cudaGetLastError() { return TakeError(true); }
cudaError_t cudaPeekAtLastError() { return TakeError(false); }
const char* cudaGetErrorString(cudaError_t e) {
  if (e == g_detail_code && e != cudaSuccess) return g_detail.c_str();
  return Text(e);
}
const char* cudaGetErrorName(cudaError_t e) { return Name(e); }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  std::memset(p, 0, sizeof *p);
  std::snprintf(p->name, sizeof p->name, "CUDA emulation on the CPU (as H100)");
  p->totalGlobalMem = sg_emu::DeviceMemoryCapacity();
  p->sharedMemPerBlock = 48 * 1024;
  p->sharedMemPerBlockOptin = 227 * 1024;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->clockRate = 1755000;
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = 132;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(p.sharedMemPerBlock); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrClockRate: *value = p.clockRate; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(p.sharedMemPerBlockOptin); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
namespace {
// A synchronization reports (once) the fault of an earlier kernel, else (launch_errors) a launch error.
cudaError_t Synchronize(bool launch_errors = true) {
  sg_emu::LandHostWrites();
  const std::pair<cudaError_t, std::string> e = sg_emu::TakeExecutionError();
  if (e.first == cudaSuccess) return launch_errors ? TakeError(true) : cudaSuccess;
  g_detail = std::string(Text(e.first)) + " (CUDA emulation: " + e.second + ")";
  g_detail_code = e.first;
  return e.first;
}
}  // namespace

cudaError_t cudaDeviceSynchronize() { return Synchronize(); }
cudaError_t cudaDeviceReset() { return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  *total_bytes = sg_emu::DeviceMemoryCapacity();
  *free_bytes = *total_bytes - sg_emu::DeviceMemoryUsed();
  return cudaSuccess;
}

// Device memory (cudaMalloc) comes from the arena (SG_EMU_DEVICE_MEMORY bytes, default the host's) and starts as
// 0xff bytes (NaN / -1), so that a kernel reading memory it never wrote shows up; managed and pinned memory are
// host memory and start zeroed (fresh pages, as in practice).
cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = sg_emu::DeviceAlloc(bytes);
  if (!*p) return cudaErrorMemoryAllocation;
  sg_emu::DeviceAccess access;
  std::memset(*p, 0xff, bytes);
  return cudaSuccess;
}
cudaError_t cudaMallocManaged(void** p, size_t bytes, unsigned flags) {
  if (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost) return cudaErrorInvalidValue;
  *p = AlignedAlloc(bytes);
  if (!*p) return cudaErrorMemoryAllocation;
  std::memset(*p, 0, bytes);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaMallocManaged(p, bytes, cudaMemAttachGlobal); }
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
cudaError_t cudaFree(void* p) {
  if (p && !sg_emu::DeviceFree(p)) std::free(p);  // managed memory
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr); e != cudaSuccess) return e;
  return Synchronize();  // synchronous: reports earlier faults
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  if (!dst || !src) return cudaErrorInvalidValue;
  // The direction must match where the pointers are (cudaMemcpyDefault: any).
  const bool dst_device = sg_emu::IsDeviceMemory(dst), src_device = sg_emu::IsDeviceMemory(src);
  if ((kind == cudaMemcpyHostToDevice && (!dst_device || src_device)) ||
      (kind == cudaMemcpyDeviceToHost && (dst_device || !src_device)) ||
      (kind == cudaMemcpyDeviceToDevice && (!dst_device || !src_device)) ||
      (kind == cudaMemcpyHostToHost && (dst_device || src_device)))
    return cudaErrorInvalidValue;
  sg_emu::LandHostWrites();  // earlier copies into host memory come first, in stream order
  sg_emu::DeviceAccess access;
  if (!dst_device) {
    const char* from = static_cast<const char*>(src);
    sg_emu::PendingHostWrites& p = sg_emu::Pending();
    std::lock_guard<std::mutex> lock(p.mu);
    p.writes.emplace_back(dst, std::vector<char>(from, from + bytes));
    return cudaSuccess;
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes, nullptr); }
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (bytes == 0) return cudaSuccess;
  if (!p) return cudaErrorInvalidValue;
  sg_emu::LandHostWrites();
  sg_emu::DeviceAccess access;
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemAdvise(const void*, size_t, cudaMemoryAdvise, int) { return cudaSuccess; }
cudaError_t cudaMemAdvise(const void*, size_t, cudaMemoryAdvise, cudaMemLocation) { return cudaSuccess; }
cudaError_t cudaMemPrefetchAsync(const void*, size_t, int, cudaStream_t) { return cudaSuccess; }

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  *s = reinterpret_cast<cudaStream_t>(new CUstream_fake{flags});
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete reinterpret_cast<CUstream_fake*>(s);
  return cudaSuccess;
}
// Launches run when issued: a stream is always idle, and a synchronization or query reports (once) the fault of an
// earlier kernel.
cudaError_t cudaStreamSynchronize(cudaStream_t) { return Synchronize(); }
cudaError_t cudaStreamQuery(cudaStream_t) { return Synchronize(/*launch_errors=*/false); }
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = reinterpret_cast<cudaEvent_t>(new int(0));
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<int*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return Synchronize(); }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return cudaSuccess; }

// ---------------------------------------------------------------------------------------------------------------
// cuBLAS

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}
const char* cublasGetStatusString(cublasStatus_t s) { return cublasGetStatusName(s); }

namespace {

enum class Rounding { kNone, kTF32, kBF16 };

float RoundInput(float x, Rounding r) {
  switch (r) {
    case Rounding::kNone: return x;
    case Rounding::kBF16: return sg::BF16ToF32(sg::F32ToBF16(x));
    case Rounding::kTF32: {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      if ((u & 0x7fffffffu) >= 0x7f800000u) return x;  // inf / NaN
      u += 0xfffu + ((u >> 13) & 1u);                  // round to nearest even at 10 mantissa bits
      u &= ~0x1fffu;
      float y;
      std::memcpy(&y, &u, 4);
      return y;
    }
  }
  return x;
}
double RoundInput(double x, Rounding) { return x; }

// Column-major C[m x n] = alpha op(A) op(B) + beta C, as cuBLAS: argument checks first, then the quick returns
// (C untouched when m or n is 0, or when alpha or k is 0 and beta is 1); beta == 0 does not read C, alpha == 0
// does not read A or B.
template <typename T>
cublasStatus_t Gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const T* alpha,
                    const T* A, int lda, const T* B, int ldb, const T* beta, T* C, int ldc, Rounding rounding) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  auto op_ok = [](cublasOperation_t o) { return o == CUBLAS_OP_N || o == CUBLAS_OP_T || o == CUBLAS_OP_C; };
  if (!op_ok(ta) || !op_ok(tb) || m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  const bool na = ta == CUBLAS_OP_N, nb = tb == CUBLAS_OP_N;
  if (lda < std::max(1, na ? m : k) || ldb < std::max(1, nb ? k : n) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  const T a = *alpha, b = *beta;
  if (m == 0 || n == 0 || ((a == T(0) || k == 0) && b == T(1))) return CUBLAS_STATUS_SUCCESS;
  sg_emu::DeviceAccess access;
  const bool use_ab = a != T(0) && k > 0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double acc = 0;
      if (use_ab)
        for (int p = 0; p < k; ++p) {
          const T x = na ? A[i + static_cast<int64_t>(p) * lda] : A[p + static_cast<int64_t>(i) * lda];
          const T y = nb ? B[p + static_cast<int64_t>(j) * ldb] : B[j + static_cast<int64_t>(p) * ldb];
          acc += static_cast<double>(RoundInput(x, rounding)) * static_cast<double>(RoundInput(y, rounding));
        }
      T& c = C[i + static_cast<int64_t>(j) * ldc];
      const double prior = b == T(0) ? 0.0 : static_cast<double>(b) * static_cast<double>(c);
      c = static_cast<T>(static_cast<double>(a) * acc + prior);
    }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                           const float* beta, float* C, int ldc) {
  const Rounding r = handle && handle->math == CUBLAS_TF32_TENSOR_OP_MATH ? Rounding::kTF32 : Rounding::kNone;
  return Gemm<float>(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, r);
}
cublasStatus_t cublasDgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const double* alpha, const double* A, int lda, const double* B, int ldb,
                           const double* beta, double* C, int ldc) {
  return Gemm<double>(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, Rounding::kNone);
}
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (Atype == CUDA_R_32F && Btype == CUDA_R_32F && Ctype == CUDA_R_32F) {
    Rounding r;
    switch (computeType) {
      case CUBLAS_COMPUTE_32F:
        r = handle->math == CUBLAS_TF32_TENSOR_OP_MATH ? Rounding::kTF32 : Rounding::kNone;
        break;
      case CUBLAS_COMPUTE_32F_PEDANTIC: r = Rounding::kNone; break;
      case CUBLAS_COMPUTE_32F_FAST_TF32: r = Rounding::kTF32; break;
      case CUBLAS_COMPUTE_32F_FAST_16BF: r = Rounding::kBF16; break;
      default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return Gemm<float>(handle, transa, transb, m, n, k, static_cast<const float*>(alpha),
                       static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb,
                       static_cast<const float*>(beta), static_cast<float*>(C), ldc, r);
  }
  if (Atype == CUDA_R_64F && Btype == CUDA_R_64F && Ctype == CUDA_R_64F &&
      (computeType == CUBLAS_COMPUTE_64F || computeType == CUBLAS_COMPUTE_64F_PEDANTIC))
    return Gemm<double>(handle, transa, transb, m, n, k, static_cast<const double*>(alpha),
                        static_cast<const double*>(A), lda, static_cast<const double*>(B), ldb,
                        static_cast<const double*>(beta), static_cast<double*>(C), ldc, Rounding::kNone);
  return CUBLAS_STATUS_NOT_SUPPORTED;
}
