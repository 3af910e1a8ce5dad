#include "core/models/footprint.h"

namespace sg {

absl::Status CheckConfigBounds(std::initializer_list<std::tuple<const char*, int64_t, int64_t>> fields) {
  for (const auto& [name, v, max] : fields) {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config field '", name, "' must be positive, got ", v));
    if (v > max)
      return absl::InvalidArgumentError(
          absl::StrCat("config field '", name, "' is ", v, ", more than the engine supports (", max, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckFootprintFits(const ModelFootprint& f, int64_t available, const std::string& what) {
  if (available < 0 || f.bytes <= available) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(what, ": the model needs ", f.bytes, " bytes (", f.parameters,
                                                   " parameters in ", f.tensors, " tensors, values and gradients) and ",
                                                   available, " bytes are available; refused before allocating"));
}

}  // namespace sg
