// What every bad-input test asserts besides the error itself: it came within a time bound and a memory bound.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace sg::testing {

inline std::string TmpDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  mkdir(dir.c_str(), 0755);
  return dir;
}

inline std::string WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

inline std::string MakeFifo(const std::string& path) {
  unlink(path.c_str());
  EXPECT_EQ(mkfifo(path.c_str(), 0644), 0) << path;
  return path;
}

// Peak resident memory of this process so far (VmHWM), in bytes.
inline int64_t PeakRss() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmHWM:") {
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

// Runs f on a thread and fails unless it returns within `seconds` and raises the process's peak memory by less
// than max_rss_growth bytes. `unblock` (if given) is called on a timeout to release a reader stuck in a blocking
// call (a FIFO's writer end), so that the test can report instead of hanging too.
inline void Bounded(const char* what, double seconds, int64_t max_rss_growth, const std::function<void()>& f,
                    const std::function<void()>& unblock = nullptr) {
  const int64_t rss_before = PeakRss();
  const auto start = std::chrono::steady_clock::now();
  std::packaged_task<void()> task(f);
  std::future<void> done = task.get_future();
  std::thread runner(std::move(task));
  if (done.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    ADD_FAILURE() << what << ": no answer within " << seconds << " s (a hang)";
    if (unblock) unblock();
  }
  runner.join();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t growth = PeakRss() - rss_before;
  EXPECT_LT(growth, max_rss_growth) << what << ": peak memory grew by " << growth << " bytes";
  std::printf("%s: %.3f s, peak memory +%lld bytes\n", what, took, static_cast<long long>(growth));
}

// Opens the FIFO's writing end and closes it at once: a reader blocked in open() or read() then sees EOF.
inline void ReleaseFifo(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) close(fd);
}

}  // namespace sg::testing
