#include "core/io/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"

namespace sg::io {

ReadFd& ReadFd::operator=(ReadFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

ReadFd::~ReadFd() {
  if (fd_ >= 0) close(fd_);
}

namespace {
const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}
}  // namespace

absl::StatusOr<ReadFd> OpenRegularFile(const std::string& path, struct stat* info) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  ReadFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (fd.get() < 0) return ErrnoStatus(errno, absl::StrCat(path, ": cannot open"));
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat(path, ": cannot stat"));
  if (!S_ISREG(st.st_mode))
    return absl::InvalidArgumentError(absl::StrCat(path, ": is ", KindOf(st.st_mode), ", not a regular file"));
  const int flags = fcntl(fd.get(), F_GETFL);
  if (flags < 0 || fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
    return ErrnoStatus(errno, absl::StrCat(path, ": fcntl"));
  if (info) *info = st;
  return fd;
}

bool ReadFully(int fd, void* data, size_t size, size_t* got) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = read(fd, static_cast<char*>(data) + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *got = done;
      return false;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  *got = done;
  return true;
}

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, int64_t max_bytes) {
  struct stat st;
  absl::StatusOr<ReadFd> fd = OpenRegularFile(path, &st);
  if (!fd.ok()) return fd.status();
  if (st.st_size > max_bytes)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": is ", st.st_size, " bytes, more than the limit of ", max_bytes, " bytes for this file"));
  std::string contents(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  if (!ReadFully(fd->get(), contents.data(), contents.size(), &got))
    return ErrnoStatus(errno, absl::StrCat(path, ": read failed"));
  // A file that shrank while read: what is there.
  contents.resize(got);
  return contents;
}

std::string ParentOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool LockIfLinked(int fd) {
  struct stat st;
  return flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &st) == 0 && st.st_nlink > 0;
}

void RemoveUnlocked(const std::string& dir, mode_t kind, const std::function<bool(std::string_view name)>& matches) {
  DIR* d = opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> found;
  while (const dirent* e = readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0 && matches(e->d_name))
      found.push_back(absl::StrCat(dir, "/", e->d_name));
  closedir(d);
  for (const std::string& path : found) {
    ReadFd fd(open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC));
    struct stat st;
    if (fd.get() < 0 || fstat(fd.get(), &st) != 0 || (st.st_mode & S_IFMT) != kind) continue;
    if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;  // a live writer's
    // Removed while locked: a writer that took the name meanwhile finds no link left (LockIfLinked) and makes another.
    std::error_code ignored;
    if (kind == S_IFDIR)
      std::filesystem::remove_all(path, ignored);
    else
      unlink(path.c_str());
  }
}

absl::StatusOr<LockedTemporary> LockedTemporary::Create(const std::string& path) {
  const std::string prefix = absl::StrCat(path.substr(path.rfind('/') + 1), ".tmp.");
  RemoveUnlocked(ParentOf(path), S_IFREG, [&](std::string_view name) { return name.rfind(prefix, 0) == 0; });
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  for (int attempt = 0; attempt < 3; ++attempt) {
    ReadFd fd(open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (fd.get() < 0) return ErrnoStatus(errno, absl::StrCat(path, ": cannot create ", temp));
    if (LockIfLinked(fd.get())) return LockedTemporary(temp, std::move(fd));
  }
  return absl::UnavailableError(absl::StrCat(temp, ": cannot lock it, or removed by another process as soon as made"));
}

}  // namespace sg::io
