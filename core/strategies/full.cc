// full: the whole sequence is one chunk and every layer keeps its activations (the reference).
#include "core/strategy.h"

namespace sg {

GradResult FullBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  const Chunk all{0, T};
  auto state = m.NewState(StateOptions{T, o.page_size, /*resident_layers=*/L, /*resident_grad_layers=*/1,
                                       /*adjoint_window=*/0, /*sparse_pages=*/o.sparse_pages}
                              .Documents(s.doc_starts)
                              .Training(o.seed));
  m.set_lm_chunk(o.lm_chunk);

  std::vector<LayerSaved> saved(L);
  Tensor x = m.Embed(s.ids.data(), all);
  for (int l = 0; l < L; ++l) {
    ThrowIfCancelled(o);
    x = m.LayerForward(l, all, x, *state, &saved[l]);
  }
  HeadResult head = m.HeadLoss(all, x, s.labels.data(), s.objective.get(), grad_scale, /*need_grad=*/true);
  x.Reset();

  Tensor dx = std::move(head.dh);
  for (int l = L - 1; l >= 0; --l) {
    ThrowIfCancelled(o);
    dx = m.LayerBackward(l, all, dx, saved[l], *state);
    saved[l].Clear();
    state->Release(l, 0);
  }
  m.EmbedBackward(s.ids.data(), all, dx);
  return {head.loss_sum, head.tokens};
}

}  // namespace sg
