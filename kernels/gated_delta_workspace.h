// The workspace of gated_delta_backward (kernels/ops.inc), laid out alike by every backend so that
// gated_delta_workspace_elems is one formula (the meta backend plans with the CPU's).
//
// The backward walks the tokens in reverse and needs the state before each one. It keeps, per value head, the state
// at the start of every block of `block` tokens (checkpoints), recomputes one block's states from its checkpoint,
// and walks that block backward: two forward passes and O((n / block + block) dk dv) state memory per head, least
// at block ~ sqrt(n).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sg {

struct GatedDeltaWorkspace {
  int64_t block = 1;   // tokens per block
  int64_t blocks = 0;  // blocks (= checkpoints) per head
  // Element offsets of the parts: checkpoints [v_heads][blocks][dk][dv], the states before each token of the
  // block being walked [v_heads][block][dk][dv], the state gradient [v_heads][dk][dv], and the per-value-head
  // gradients of q and k [n][v_heads][dk] (summed over the value heads of each key head at the end).
  int64_t checkpoints = 0, block_states = 0, state_grad = 0, dq_heads = 0, dk_heads = 0, elems = 0;
};

inline GatedDeltaWorkspace GatedDeltaLayout(int64_t n, int64_t v_heads, int64_t dk, int64_t dv) {
  GatedDeltaWorkspace w;
  while (w.block * w.block < n) ++w.block;
  w.blocks = (n + w.block - 1) / w.block;
  const int64_t state = v_heads * dk * dv;
  w.block_states = w.checkpoints + w.blocks * state;
  w.state_grad = w.block_states + w.block * state;
  w.dq_heads = w.state_grad + state;
  w.dk_heads = w.dq_heads + n * v_heads * dk;
  w.elems = w.dk_heads + n * v_heads * dk;
  return w;
}

// Key head of value head h: the value heads of one key head are adjacent (transformers' repeat_interleave).
inline void CheckGatedDeltaHeads(int64_t k_heads, int64_t v_heads, const char* op) {
  if (k_heads <= 0 || v_heads % k_heads != 0)
    throw std::invalid_argument(std::string(op) + ": v_heads (" + std::to_string(v_heads) +
                                ") must be a positive multiple of k_heads (" + std::to_string(k_heads) + ")");
}

}  // namespace sg
