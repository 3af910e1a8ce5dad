// The CPU backend's CopyEngine: one worker thread per lane runs the lane's memcpys in order, so that KV offload
// overlaps its copies with compute on the CPU as it does on a GPU, and its waits are exercised by every test.
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <thread>

#include "kernels/cpu/cpu_ops.h"

namespace sg::cpu {
namespace {

class Lane {
 public:
  Lane() : worker_([this] { Run(); }) {}
  ~Lane() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void Copy(void* dst, const void* src, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({dst, src, bytes});
      ++issued_;
    }
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t target = issued_;
    done_cv_.wait(lock, [&] { return finished_ >= target; });
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    size_t bytes;
  };
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      Job j = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::memcpy(j.dst, j.src, j.bytes);
      lock.lock();
      ++finished_;
      done_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job> queue_;
  int64_t issued_ = 0, finished_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

constexpr int kLanes = 4;

Lane& LaneAt(int lane) {
  static Lane* lanes = new Lane[kLanes];  // never destroyed: copies may be waited on during static teardown
  if (lane < 0 || lane >= kLanes) throw std::out_of_range("copy engine lane out of range");
  return lanes[lane];
}

void* AllocHost(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace

CopyEngine HostCopyEngine() {
  CopyEngine e;
  e.alloc_host = AllocHost;
  e.free_host = [](void* p) { std::free(p); };
  e.copy_async = [](void* dst, const void* src, size_t bytes, int lane) { LaneAt(lane).Copy(dst, src, bytes); };
  e.wait = [](int lane) { LaneAt(lane).Wait(); };
  return e;
}

}  // namespace sg::cpu
