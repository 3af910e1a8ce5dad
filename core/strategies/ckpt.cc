// ckpt: layer-level gradient checkpointing. Forward keeps only each layer's input; backward recomputes a
// layer (its KV cache included) right before backpropagating through it.
#include "core/strategy.h"

namespace sg {

GradResult CheckpointedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  const Chunk all{0, T};
  auto state = m.NewState(StateOptions{T, o.page_size, /*resident_layers=*/1, /*resident_grad_layers=*/1}
                              .Documents(s.doc_starts)
                              .Training(o.seed));
  m.set_lm_chunk(o.lm_chunk);

  std::vector<Tensor> inputs(L);
  Tensor x = m.Embed(s.ids.data(), all);
  for (int l = 0; l < L; ++l) {
    ThrowIfCancelled(o);
    inputs[l] = m.KeepRows(x);  // in the activation dtype
    x = m.LayerForward(l, all, x, *state, /*saved=*/nullptr);
    state->Release(l, 0);
  }
  HeadResult head = m.HeadLoss(all, x, s.labels.data(), s.objective.get(), grad_scale, /*need_grad=*/true);
  x.Reset();

  Tensor dx = std::move(head.dh);
  for (int l = L - 1; l >= 0; --l) {
    ThrowIfCancelled(o);
    LayerSaved saved;
    const Tensor input = m.ReadRows(inputs[l], all);  // in the compute dtype
    inputs[l].Reset();
    m.LayerForward(l, all, input, *state, &saved);
    dx = m.LayerBackward(l, all, dx, saved, *state);
    state->Release(l, 0);
  }
  m.EmbedBackward(s.ids.data(), all, dx);
  return {head.loss_sum, head.tokens};
}

}  // namespace sg
