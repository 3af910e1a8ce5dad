// Opening files to read without being fooled by what a path names: only regular files are read, and a FIFO or
// device is refused without blocking on it (open with O_NONBLOCK, fstat, then blocking reads).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace sg::io {

// An open file descriptor, closed on destruction.
class ReadFd {
 public:
  ReadFd() = default;
  explicit ReadFd(int fd) : fd_(fd) {}
  ReadFd(ReadFd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  ReadFd& operator=(ReadFd&& other) noexcept;
  ReadFd(const ReadFd&) = delete;
  ReadFd& operator=(const ReadFd&) = delete;
  ~ReadFd();
  int get() const { return fd_; }

 private:
  int fd_ = -1;
};

// Opens `path` for reading when it is a regular file; *info (if not null) gets its fstat. A directory, FIFO,
// socket or device is INVALID_ARGUMENT naming the path and what it is, returned without blocking.
absl::StatusOr<ReadFd> OpenRegularFile(const std::string& path, struct stat* info = nullptr);

// The whole file, refused (before reading) when larger than max_bytes; errors name the path.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes);

// Reads exactly `size` bytes (short of EOF) at the current position; false with errno set on error.
bool ReadFully(int fd, void* data, size_t size, size_t* got);

// The directory part of `path`: "." when it has none, "/" for an entry of the root.
std::string ParentOf(const std::string& path);

// Writers hold what they are still writing (a temporary file, a staging directory) under an exclusive flock, which
// goes with their process: whatever can be locked was left by a killed writer.
// LockIfLinked takes that lock on `fd` without waiting; false when another holds it or the entry has no link left
// (removed as stale by another process between its creation and this lock). The lock lasts until fd is closed.
bool LockIfLinked(int fd);

// Removes the entries of `dir` of one kind (S_IFREG: files, S_IFDIR: directories with what they hold) whose names
// `matches` accepts and that no live writer holds (see above); links and other kinds of entry stay. Best effort:
// what cannot be opened or removed stays.
void RemoveUnlocked(const std::string& dir, mode_t kind, const std::function<bool(std::string_view name)>& matches);

// The temporary "<path>.tmp.<pid>" a writer fills and then renames over `path`, created (empty) and held locked
// until destroyed, i.e. until after the rename. Creating one first removes the temporaries of `path` that killed
// writers left.
class LockedTemporary {
 public:
  static absl::StatusOr<LockedTemporary> Create(const std::string& path);
  const std::string& path() const { return path_; }

 private:
  LockedTemporary(std::string path, ReadFd lock) : path_(std::move(path)), lock_(std::move(lock)) {}
  std::string path_;
  ReadFd lock_;
};

}  // namespace sg::io
