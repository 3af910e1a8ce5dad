// adjoint: adjoint sharding for state-space models (Xu et al., arXiv 2501.00692), made exact.
// The paper writes the gradient of a layer's scan parameters as a sum of independent vector-Jacobian products over
// pairs (t, i), i <= t, with adjoint states lambda^{t,i} = C_t A_t ... A_{i+1}: each needs one state vector, and
// they spread over threads freely (kernels: selective_scan_backward_pairs, parallel over channels). Its K-layer
// formula gives every layer the head's cotangent dL/dy_K, which ignores that the layers above read layer k's
// output: exact for one layer only (../shared/notes/adjoint-sharding.md). Here every layer gets its own cotangent
// dL/dy_k, from seco's schedule: chunks in reverse, layers top-down, and instead of the scan state gradient, the
// model relays to earlier chunks the cotangents of the tokens their pairs reach.
//   --adjoint_window=T̄ keeps only the pairs with t - i < T̄ (truncated adjoint sharding: T̄T - T̄(T̄-1)/2 pairs per
//   layer and channel instead of T(T+1)/2, and a relay of T̄ - 1 tokens).
//   --adjoint_form=scan relays the state gradient and runs one reverse scan per chunk: the same gradient in O(T).
//   --adjoint_form=paper is the paper's formula as printed, kept to show the defect.
#include <algorithm>
#include <stdexcept>

#include "core/strategies/chunk_steps.h"

namespace sg {

GradResult AdjointBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  if (absl::Status valid = ValidateStrategyForModel(o, m); !valid.ok())
    throw std::invalid_argument(std::string(valid.message()));
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  StateOptions state{T, o.page_size, /*resident_layers=*/L, /*resident_grad_layers=*/L};
  state.adjoint_window = o.adjoint_form == "scan" ? 0 : std::min(o.adjoint_window, T);
  return SecoSchedule(m, s, grad_scale, o, state.Training(o.seed),
                      o.adjoint_form == "paper" ? LayerCotangent::kHeadForEveryLayer : LayerCotangent::kOwn);
}

}  // namespace sg
