// streambp: stream backpropagation (StreamBP §3.2.2). Exact, layer by layer, with the sequence partitioned
// inside every layer so that only one partition's activations exist at a time.
// Forward: layer-major; each layer runs partition by partition over its growing KV cache and keeps only its input.
// Backward, from the top layer: compute the layer's K/V for the whole sequence once, then for partitions in
// reverse recompute the partition (its queries attend to keys [0, end) only: the causal saving) and backprop it,
// accumulating dW, the partition's d(input) and dK/dV of all earlier keys; a partition's own dK/dV is complete
// once every later partition is done, which the reverse order guarantees.
// The LM head works per token, so the top layer and the head go together: the forward stops at the top layer's
// input, and the backward of the top layer computes each partition's output, its head loss and gradient, and
// backprops it at once — the top layer runs forward once, not twice.
#include "core/strategies/chunk_steps.h"

namespace sg {

GradResult StreamBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  const std::vector<Chunk> parts = SplitIntoChunks(T, o.chunk);
  auto state = m.NewState(StateOptions{T, o.page_size, /*resident_layers=*/1, /*resident_grad_layers=*/1}
                              .Documents(s.doc_starts)
                              .Training(o.seed));
  m.set_lm_chunk(o.lm_chunk);

  std::vector<Tensor> inputs(L);  // inputs[l]: layer l's input, whole sequence (Model::NewRows)
  inputs[0] = m.NewRows(T);
  for (const Chunk& c : parts) m.StoreRows(inputs[0], c, m.Embed(s.ids.data(), c));
  for (int l = 0; l + 1 < L; ++l) {
    ThrowIfCancelled(o);
    inputs[l + 1] = m.NewRows(T);
    for (const Chunk& c : parts)
      m.StoreRows(inputs[l + 1], c, m.LayerForward(l, c, m.ReadRows(inputs[l], c), *state, /*saved=*/nullptr));
    state->Release(l, 0);
  }

  GradResult result;
  Tensor dy;  // gradient of the current layer's output, whole sequence
  for (int l = L - 1; l >= 0; --l) {
    ThrowIfCancelled(o);
    for (const Chunk& c : parts) m.LayerAppendState(l, c, m.ReadRows(inputs[l], c), *state);
    Tensor dx = m.NewGradRows(T);
    for (auto c = parts.rbegin(); c != parts.rend(); ++c) {
      LayerSaved saved;
      Tensor y = m.LayerForward(l, *c, m.ReadRows(inputs[l], *c), *state, &saved);
      Tensor dyc;
      if (l == L - 1) {
        HeadResult head = m.HeadLoss(*c, y, s.labels.data(), s.objective.get(), grad_scale, /*need_grad=*/true);
        result.loss_sum += head.loss_sum;
        result.tokens += head.tokens;
        dyc = std::move(head.dh);
      } else {
        dyc = dy.Rows(c->begin, c->end);
      }
      y.Reset();
      m.StoreRows(dx, *c, m.LayerBackward(l, *c, dyc, saved, *state));
      state->Release(l, c->begin);
    }
    inputs[l].Reset();
    dy = std::move(dx);
  }
  m.EmbedBackward(s.ids.data(), {0, T}, dy);
  return result;
}

}  // namespace sg
