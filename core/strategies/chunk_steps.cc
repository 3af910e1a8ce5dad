#include "core/strategies/chunk_steps.h"

#include <vector>

namespace sg {

HeadResult ForwardChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, bool with_loss) {
  Tensor x = m.Embed(s.ids.data(), c);
  for (int l = 0; l < m.num_layers(); ++l) x = m.LayerForward(l, c, x, state, /*saved=*/nullptr);
  if (!with_loss) return {};
  return m.HeadLoss(c, x, s.labels.data(), /*grad_scale=*/0, /*need_grad=*/false);
}

HeadResult BackpropChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, double loss_scale) {
  const int L = m.num_layers();
  std::vector<LayerSaved> saved(L);
  Tensor x = m.Embed(s.ids.data(), c);
  for (int l = 0; l < L; ++l) x = m.LayerForward(l, c, x, state, &saved[l]);
  HeadResult head = m.HeadLoss(c, x, s.labels.data(), loss_scale, /*need_grad=*/true);
  x.Reset();

  Tensor dx = std::move(head.dh);
  for (int l = L - 1; l >= 0; --l) {
    dx = m.LayerBackward(l, c, dx, saved[l], state);
    saved[l].Clear();
  }
  m.EmbedBackward(s.ids.data(), c, dx);
  ReleaseFrom(m, state, c.begin);
  return head;
}

void ReleaseFrom(Model& m, SequenceState& state, int64_t from) {
  for (int l = 0; l < m.num_layers(); ++l) state.Release(l, from);
}

}  // namespace sg
