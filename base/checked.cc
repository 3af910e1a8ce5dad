#include "base/checked.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace sg {

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool CheckedAdd(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

absl::StatusOr<int64_t> CheckedNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0)
      return absl::InvalidArgumentError(absl::StrCat("tensor shape ", ShapeText(shape), " has a negative dimension"));
    if (!CheckedMul(n, d, &n))
      return absl::ResourceExhaustedError(
          absl::StrCat("tensor shape ", ShapeText(shape), " has more than 2^63 elements"));
  }
  return n;
}

absl::StatusOr<int64_t> CheckedBytes(DType dtype, const std::vector<int64_t>& shape) {
  absl::StatusOr<int64_t> n = CheckedNumel(shape);
  if (!n.ok()) return n;
  int64_t bytes = 0;
  if (!CheckedMul(*n, static_cast<int64_t>(DTypeSize(dtype)), &bytes) || !CheckedAdd(bytes, 63, &bytes))
    return absl::ResourceExhaustedError(absl::StrCat("tensor shape ", ShapeText(shape), " has more than 2^63 bytes"));
  return bytes - 63;
}

}  // namespace sg
