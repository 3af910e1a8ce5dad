// Size arithmetic that refuses to overflow: tensor shapes' elements and bytes, products and sums of sizes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace sg {

// Elements and bytes of a tensor shape, computed with overflow checks: INVALID_ARGUMENT for a negative dimension,
// RESOURCE_EXHAUSTED when the count does not fit in int64 (the message gives the shape).
absl::StatusOr<int64_t> CheckedNumel(const std::vector<int64_t>& shape);
absl::StatusOr<int64_t> CheckedBytes(DType dtype, const std::vector<int64_t>& shape);
// a * b and a + b for non-negative sizes; false on overflow.
bool CheckedMul(int64_t a, int64_t b, int64_t* out);
bool CheckedAdd(int64_t a, int64_t b, int64_t* out);
// A shape as messages write it: "[2, 3]".
std::string ShapeText(const std::vector<int64_t>& shape);

}  // namespace sg
