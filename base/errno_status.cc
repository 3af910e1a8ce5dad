#include "base/errno_status.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace sg {

absl::StatusCode ErrnoCode(int err) { return absl::ErrnoToStatusCode(err); }

absl::Status ErrnoStatus(int err, const std::string& what) {
  return absl::Status(ErrnoCode(err), absl::StrCat(what, ": ", std::strerror(err)));
}

}  // namespace sg
