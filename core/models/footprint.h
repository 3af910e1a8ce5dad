// What a model of a config takes once created, counted before anything is allocated; each family's Footprint
// (core/models/<family>/config.h) counts its tensors with FootprintCounter.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/checked.h"
#include "base/dtype.h"

namespace sg {

// What a model of this configuration takes once created: its parameters, and the host or device bytes of
// their values and gradients (two copies, each tensor rounded to the allocator's 64 bytes, plus bookkeeping per
// tensor). Every product and sum is overflow-checked: an overflow, or a field past what the engine represents
// (token ids and page indices are int32, layer indices int), is an error naming the config field.
struct ModelFootprint {
  int64_t parameters = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;
  int64_t expert_bytes = 0;  // of bytes, those of a mixture of experts' expert weights (--offload_experts moves them)
};

// RESOURCE_EXHAUSTED, naming the bytes needed and available, when a model of footprint f does not fit in what
// `available` bytes (< 0: unknown, always fits) allow. `what` names the model (its config file or preset).
absl::Status CheckFootprintFits(const ModelFootprint& f, int64_t available, const std::string& what);

// Accumulates parameter tensors with overflow checks; the first overflow is kept as an error naming `fields`.
class FootprintCounter {
 public:
  explicit FootprintCounter(DType dtype) : elem_bytes_(static_cast<int64_t>(DTypeSize(dtype))) {}

  // A product of named config values, e.g. {{"vocab_size", V}, {"hidden_size", d}}.
  int64_t Product(std::initializer_list<std::pair<const char*, int64_t>> factors) {
    int64_t n = 1;
    for (const auto& [name, v] : factors) {
      if (!CheckedMul(n, v, &n)) {
        std::vector<std::string> names;
        for (const auto& f : factors)  // "hidden_size 4096"; a constant factor as itself
          names.push_back(f.first == absl::StrCat(f.second) ? f.first : absl::StrCat(f.first, " ", f.second));
        Fail(absl::StrCat("the product of ", absl::StrJoin(names, " x "), " overflows int64"));
        return 0;
      }
    }
    return n;
  }
  int64_t Sum(const char* what, int64_t a, int64_t b) {
    int64_t s = 0;
    if (!CheckedAdd(a, b, &s)) Fail(absl::StrCat(what, " overflows int64"));
    return s;
  }

  // `count` tensors (one per layer, say) of `elements` each, with their gradients.
  void Add(int64_t elements, int64_t count = 1) {
    int64_t bytes = 0, per = 0, total = 0;
    // 64-byte rounding and ~256 bytes of bookkeeping (name, shape, shared storage) per tensor, twice.
    if (!CheckedMul(elements, elem_bytes_, &bytes) || !CheckedAdd(bytes, 63 + 256, &per) ||
        !CheckedMul(per / 64 * 64, 2 * count, &total) || !CheckedAdd(f_.bytes, total, &f_.bytes) ||
        !CheckedMul(elements, count, &total) || !CheckedAdd(f_.parameters, total, &f_.parameters) ||
        !CheckedAdd(f_.tensors, count, &f_.tensors))
      Fail("the model's size overflows int64");
  }

  // Add's, for a mixture of experts' expert weights.
  void AddExperts(int64_t elements, int64_t count) {
    const int64_t before = f_.bytes;
    Add(elements, count);
    f_.expert_bytes += f_.bytes - before;
  }

  absl::StatusOr<ModelFootprint> Result() const {
    if (!error_.empty()) return absl::InvalidArgumentError(absl::StrCat("config: ", error_));
    return f_;
  }

 private:
  void Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
  }
  int64_t elem_bytes_;
  ModelFootprint f_;
  std::string error_;
};

// Each field (name, value, maximum) positive and at most its maximum; errors name the config field.
absl::Status CheckConfigBounds(std::initializer_list<std::tuple<const char*, int64_t, int64_t>> fields);

}  // namespace sg
