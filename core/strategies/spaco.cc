// spaco: sparse chunk-wise optimisation (SpaCO, Algorithm 2), with sampling and compensation that make the
// gradient estimate exactly unbiased.
//
// The exact gradient is a sum over chains of chunks j = c_1 > c_2 > ... > c_m: the loss of chunk j reaches the
// parameters used in chunk c_m through the state gradients relayed along the chain. A chain survives only when
// all of its m chunks are backpropagated. The paper draws exactly t of k chunks and compensates each relay by
// k/t, assuming survival probability (t/k)^m; without replacement it is t(t-1)...(t-m+1) / (k(k-1)...(k-m+1)), so
// longer chains come out biased. Here every chunk is kept independently with probability q = t/k (t chunks on
// average), so a chain survives with probability exactly q^m, and a kept chunk scales its whole upstream (its own
// loss and the state gradient relayed into it) by 1/q: each chain collects q^-m, and E[estimate] = gradient.
//
// The cap (paper: 2) bounds the factor on relayed state gradients at spaco_cap while a chunk's own loss keeps
// 1/q: single-chunk terms stay unbiased and a chain of m chunks is damped to (cap q)^(m-1) of its expectation,
// trading that bias for lower variance.
#include <cstdint>

#include "core/strategies/chunk_steps.h"

namespace sg {
namespace {

// splitmix64: a portable, seedable generator (the same draws on every platform and binding).
uint64_t NextRandom(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<bool> SampleChunks(int64_t k, double q, uint64_t seed) {
  std::vector<bool> keep(k);
  for (int64_t i = 0; i < k; ++i) keep[i] = static_cast<double>(NextRandom(seed) >> 11) * 0x1.0p-53 < q;
  return keep;
}

}  // namespace

GradResult SparseChunkedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  const std::vector<Chunk> chunks = SplitIntoChunks(T, o.chunk);
  const int64_t k = static_cast<int64_t>(chunks.size());
  const double q = std::min(1.0, static_cast<double>(o.spaco_budget) / static_cast<double>(k));
  const double loss_factor = 1.0 / q;
  const double relay_factor = o.spaco_cap > 0 ? std::min(loss_factor, o.spaco_cap) : loss_factor;
  const std::vector<bool> keep = SampleChunks(k, q, o.seed);

  auto state = m.NewState(StateOptions{T, o.page_size, /*resident_layers=*/L, /*resident_grad_layers=*/L}
                              .Documents(s.doc_starts)
                              .Training(o.seed));
  m.set_lm_chunk(o.lm_chunk);
  for (int64_t i = 0; i < k; ++i)
    if (!keep[i]) state->SkipGrad(chunks[i]);  // relays into dropped chunks would be discarded: skip them

  // Stage 1: forward every chunk, keeping the state; chunks that are not backpropagated report their loss here.
  // A kept last chunk is left to stage 2, which computes it first (no other chunk reads its state).
  GradResult result;
  result.chunks = k;
  result.chunks_backpropagated = 0;
  for (int64_t i = 0; i < (keep[k - 1] ? k - 1 : k); ++i) {
    ThrowIfCancelled(o);
    const HeadResult head = ForwardChunk(m, s, chunks[i], *state, /*with_loss=*/!keep[i]);
    result.loss_sum += head.loss_sum;
    result.tokens += head.tokens;
  }

  // Stage 2: the kept chunks in reverse, each with its upstream compensated.
  for (int64_t i = k - 1; i >= 0; --i) {
    ThrowIfCancelled(o);
    if (!keep[i]) {
      ReleaseFrom(m, *state, chunks[i].begin);
      continue;
    }
    for (int l = 0; l < L; ++l) state->ScaleGrad(l, chunks[i], relay_factor);
    const HeadResult head = BackpropChunk(m, s, chunks[i], *state, grad_scale * loss_factor);
    result.loss_sum += head.loss_sum;
    result.tokens += head.tokens;
    ++result.chunks_backpropagated;
  }
  return result;
}

}  // namespace sg
