// The workspace of ssd_backward (kernels/ops.inc), laid out alike by every backend (the meta planner sizes it with
// the CPU's formula): gated delta's layout (kernels/gated_delta_workspace.h), a head's state being [head_dim][N]
// and the per-head rows of dC and dB [n][heads][N] taking the places of dq and dk (summed over the heads of each
// group at the end).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/gated_delta_workspace.h"

namespace sg {

struct SsdWorkspace {
  GatedDeltaWorkspace w;
  int64_t block() const { return w.block; }
  int64_t blocks() const { return w.blocks; }
  int64_t checkpoints() const { return w.checkpoints; }    // [heads][blocks][head_dim][N]
  int64_t block_states() const { return w.block_states; }  // [heads][block][head_dim][N]
  int64_t state_grad() const { return w.state_grad; }      // [heads][head_dim][N]
  int64_t dC_heads() const { return w.dq_heads; }          // [n][heads][N]
  int64_t dB_heads() const { return w.dk_heads; }          // [n][heads][N]
  int64_t elems() const { return w.elems; }
};

inline SsdWorkspace SsdLayout(int64_t n, int64_t heads, int64_t head_dim, int64_t N) {
  return {GatedDeltaLayout(n, heads, N, head_dim)};
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

// The group size of a gated group RMSNorm must divide the row.
inline void CheckNormGroups(int64_t dim, int64_t group_size, const char* op) {
  if (group_size <= 0 || dim % group_size != 0)
    throw std::invalid_argument(std::string(op) + ": group_size (" + std::to_string(group_size) +
                                ") must be a positive divisor of dim (" + std::to_string(dim) + ")");
}

}  // namespace sg
