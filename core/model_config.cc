#include "core/model_config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/checked.h"

namespace sg {

double DynamicRopeBase(const TransformerConfig& c, int64_t tokens) {
  const double m = static_cast<double>(c.max_position_embeddings);
  const double past = std::max(0.0, static_cast<double>(tokens) - m);
  const double d = static_cast<double>(c.head_dim);
  return c.rope_theta * std::pow(1 + c.rope_scaling.factor * past / m, d / (d - 2));
}

namespace {

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

absl::Status CheckBounds(std::initializer_list<std::tuple<const char*, int64_t, int64_t>> fields) {
  for (const auto& [name, v, max] : fields) {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config field '", name, "' must be positive, got ", v));
    if (v > max)
      return absl::InvalidArgumentError(
          absl::StrCat("config field '", name, "' is ", v, ", more than the engine supports (", max, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelFootprint> Footprint(const TransformerConfig& c, DType dtype) {
  if (absl::Status s = CheckBounds({{"vocab_size", c.vocab_size, INT32_MAX},
                                    {"hidden_size", c.hidden_size, INT64_MAX},
                                    {"num_hidden_layers", c.num_layers, INT32_MAX},
                                    {"num_attention_heads", c.num_heads, INT32_MAX},
                                    {"num_key_value_heads", c.num_kv_heads, INT32_MAX},
                                    {"head_dim", c.head_dim, INT64_MAX},
                                    {"intermediate_size", c.intermediate_size, INT64_MAX},
                                    {"max_position_embeddings", c.max_position_embeddings, INT64_MAX}});
      !s.ok())
    return s;
  FootprintCounter n(dtype);
  const int64_t d = c.hidden_size, L = c.num_layers, f = c.intermediate_size;
  const int64_t qd = n.Product({{"num_attention_heads", c.num_heads}, {"head_dim", c.head_dim}});
  const int64_t kvd = n.Product({{"num_key_value_heads", c.num_kv_heads}, {"head_dim", c.head_dim}});
  n.Add(n.Product({{"vocab_size", c.vocab_size}, {"hidden_size", d}}), c.tie_word_embeddings ? 1 : 2);
  n.Add(d, 2 * L + 1);  // the layers' two norms, the final norm
  n.Add(n.Product({{"num_attention_heads x head_dim", qd}, {"hidden_size", d}}), 2 * L);  // q, o
  n.Add(n.Product({{"num_key_value_heads x head_dim", kvd}, {"hidden_size", d}}), 2 * L);  // k, v
  n.Add(n.Product({{"intermediate_size", f}, {"hidden_size", d}}), 3 * L);                 // gate, up, down
  if (c.attention_bias) {
    n.Add(qd, L);
    n.Add(kvd, 2 * L);
  }
  if (c.o_bias()) n.Add(d, L);
  if (c.mlp_bias) {
    n.Add(f, 2 * L);
    n.Add(d, L);
  }
  if (c.qk_norm()) n.Add(c.head_dim, 2 * L);
  n.Add(c.head_dim / 2);  // RoPE frequencies
  return n.Result();
}

absl::StatusOr<ModelFootprint> Footprint(const MambaConfig& c, DType dtype) {
  if (absl::Status s = CheckBounds({{"vocab_size", c.vocab_size, INT32_MAX},
                                    {"hidden_size", c.hidden_size, INT64_MAX},
                                    {"state_size", c.state_size, INT64_MAX},
                                    {"num_hidden_layers", c.num_layers, INT32_MAX},
                                    {"intermediate_size", c.intermediate_size, INT64_MAX},
                                    {"conv_kernel", c.conv_kernel, INT32_MAX},
                                    {"time_step_rank", c.time_step_rank, INT64_MAX}});
      !s.ok())
    return s;
  FootprintCounter n(dtype);
  const int64_t d = c.hidden_size, E = c.intermediate_size, N = c.state_size, R = c.time_step_rank, L = c.num_layers;
  n.Add(n.Product({{"vocab_size", c.vocab_size}, {"hidden_size", d}}), c.tie_word_embeddings ? 1 : 2);
  n.Add(d, L + 1);                                                               // norms
  n.Add(n.Product({{"2", 2}, {"intermediate_size", E}, {"hidden_size", d}}), L);  // in_proj
  n.Add(n.Product({{"intermediate_size", E}, {"conv_kernel", c.conv_kernel}}), L);
  n.Add(n.Product({{"time_step_rank + 2 x state_size", n.Sum("time_step_rank + 2 x state_size", R,
                                                             n.Product({{"2", 2}, {"state_size", N}}))},
                   {"intermediate_size", E}}),
        L);                                                                      // x_proj
  n.Add(n.Product({{"intermediate_size", E}, {"time_step_rank", R}}), L);        // dt_proj
  n.Add(n.Product({{"intermediate_size", E}, {"state_size", N}}), L);            // A_log
  n.Add(n.Product({{"hidden_size", d}, {"intermediate_size", E}}), L);           // out_proj
  n.Add(E, 4 * L);  // D, dt and conv biases, in_proj bias (upper bound)
  // The scan state of one layer (held per sequence) and the widest per-token row, so that the first step's
  // allocations cannot overflow either.
  n.Product({{"intermediate_size", E}, {"state_size", N}, {"conv_kernel", c.conv_kernel}});
  return n.Result();
}

absl::Status CheckFootprintFits(const ModelFootprint& f, int64_t available, const std::string& what) {
  if (available < 0 || f.bytes <= available) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, ": the model needs ", f.bytes, " bytes (", f.parameters, " parameters in ", f.tensors,
      " tensors, values and gradients) and ", available, " bytes are available; refused before allocating"));
}

}  // namespace sg
