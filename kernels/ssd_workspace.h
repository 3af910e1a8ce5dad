// The workspace of ssd_backward (kernels/ops.inc), laid out alike by every backend (the meta planner sizes it with
// the CPU's formula): gated delta's layout (kernels/gated_delta_workspace.h), a head's state being [head_dim][N]
// and the per-head rows of dC and dB [n][heads][N] taking the places of dq and dk (summed over the heads of each
// group at the end).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/gated_delta_workspace.h"

namespace sg {

// Element offsets of the parts (a plain struct: kernels read it too).
struct SsdWorkspace {
  int64_t block = 1, blocks = 0;  // tokens per block, blocks (= checkpoints) per head
  // checkpoints [heads][blocks][head_dim][N], the states before each token of the block being walked
  // [heads][block][head_dim][N], the state gradient [heads][head_dim][N], dC and dB per head [n][heads][N].
  int64_t checkpoints = 0, block_states = 0, state_grad = 0, dC_heads = 0, dB_heads = 0, elems = 0;
};

inline SsdWorkspace SsdLayout(int64_t n, int64_t heads, int64_t head_dim, int64_t N) {
  const GatedDeltaWorkspace g = GatedDeltaLayout(n, heads, N, head_dim);
  return {g.block, g.blocks, g.checkpoints, g.block_states, g.state_grad, g.dq_heads, g.dk_heads, g.elems};
}

// The shapes and the dt limits an SSD op accepts; the heads of one group are adjacent.
inline void CheckSsdArguments(int64_t heads, int64_t groups, double dt_min, double dt_max, const char* op) {
  if (groups <= 0 || heads % groups != 0)
    throw std::invalid_argument(std::string(op) + ": heads (" + std::to_string(heads) +
                                ") must be a positive multiple of groups (" + std::to_string(groups) + ")");
  if (!(dt_min <= dt_max))
    throw std::invalid_argument(std::string(op) + ": dt_min (" + std::to_string(dt_min) + ") must not exceed dt_max (" +
                                std::to_string(dt_max) + ")");
}

// ssd_backward_pairs' window: at least the token's own pair.
inline void CheckPairsWindow(int64_t window, const char* op) {
  if (window < 1)
    throw std::invalid_argument(std::string(op) + ": window (" + std::to_string(window) + ") must be at least 1");
}

// The pairs (t, i) per head of ssd_backward_pairs over n tokens with `later` after them: i < n, i <= t <
// min(n + later, i + window).
inline int64_t SsdPairs(int64_t n, int64_t later, int64_t window) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < n; ++i) pairs += std::min(n + later, i + std::min(window, n + later)) - i;
  return pairs;
}

// The group size of a gated group RMSNorm must divide the row.
inline void CheckNormGroups(int64_t dim, int64_t group_size, const char* op) {
  if (group_size <= 0 || dim % group_size != 0)
    throw std::invalid_argument(std::string(op) + ": group_size (" + std::to_string(group_size) +
                                ") must be a positive divisor of dim (" + std::to_string(dim) + ")");
}

}  // namespace sg
