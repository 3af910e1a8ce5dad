// Statuses of failed system calls.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace sg {

// The one mapping of errno values to status codes, absl's: ENOENT -> NOT_FOUND, EACCES/EPERM/EROFS ->
// PERMISSION_DENIED, ENOTDIR/EISDIR -> FAILED_PRECONDITION, ENOSPC/EDQUOT -> RESOURCE_EXHAUSTED, EEXIST ->
// ALREADY_EXISTS, EIO -> UNKNOWN, ... Every failed system call of the engine reports its errno through it, so one
// errno gives one code whatever the call (saving, loading, reading data).
absl::StatusCode ErrnoCode(int err);

// The status of a failed system call: ErrnoCode(err), message "<what>: <strerror>".
absl::Status ErrnoStatus(int err, const std::string& what);

}  // namespace sg
