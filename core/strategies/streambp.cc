// streambp: stream backpropagation (StreamBP §3.2.2). Exact, layer by layer, with the sequence partitioned
// inside every layer so that only one partition's activations exist at a time.
// Forward: layer-major; each layer runs partition by partition over its growing KV cache and keeps only its input.
// Backward, from the top layer: compute the layer's K/V for the whole sequence once, then for partitions in
// reverse recompute the partition (its queries attend to keys [0, end) only: the causal saving) and backprop it,
// accumulating dW, the partition's d(input) and dK/dV of all earlier keys; a partition's own dK/dV is complete
// once every later partition is done, which the reverse order guarantees.
#include <cstring>

#include "core/strategies/chunk_steps.h"

namespace sg {

GradResult StreamBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  const Chunk all{0, T};
  const std::vector<Chunk> parts = SplitIntoChunks(T, o.chunk);
  auto state = m.NewState({T, o.page_size, /*resident_layers=*/1, /*resident_grad_layers=*/1});
  m.set_lm_chunk(o.lm_chunk);

  std::vector<Tensor> inputs(L + 1);
  inputs[0] = m.Embed(s.ids.data(), all);
  for (int l = 0; l < L; ++l) {
    ThrowIfCancelled(o);
    inputs[l + 1] = Tensor::Empty(&m.memory(), MemCategory::kActivations, m.dtype(), {T, m.hidden_size()});
    for (const Chunk& c : parts) {
      const Tensor y = m.LayerForward(l, c, inputs[l].Rows(c.begin, c.end), *state, /*saved=*/nullptr);
      std::memcpy(inputs[l + 1].Rows(c.begin, c.end).raw(), y.raw(), y.nbytes());
    }
    state->Release(l, 0);
  }
  HeadResult head = m.HeadLoss(all, inputs[L], s.labels.data(), s.objective.get(), grad_scale, /*need_grad=*/true);
  inputs[L].Reset();

  Tensor dy = std::move(head.dh);
  for (int l = L - 1; l >= 0; --l) {
    ThrowIfCancelled(o);
    for (const Chunk& c : parts) m.LayerAppendState(l, c, inputs[l].Rows(c.begin, c.end), *state);
    Tensor dx = Tensor::Empty(&m.memory(), MemCategory::kActivations, m.dtype(), {T, m.hidden_size()});
    for (auto c = parts.rbegin(); c != parts.rend(); ++c) {
      LayerSaved saved;
      m.LayerForward(l, *c, inputs[l].Rows(c->begin, c->end), *state, &saved);
      const Tensor dxc = m.LayerBackward(l, *c, dy.Rows(c->begin, c->end), saved, *state);
      std::memcpy(dx.Rows(c->begin, c->end).raw(), dxc.raw(), dxc.nbytes());
      state->Release(l, c->begin);
    }
    inputs[l].Reset();
    dy = std::move(dx);
  }
  m.EmbedBackward(s.ids.data(), all, dy);
  return {head.loss_sum, head.tokens};
}

}  // namespace sg
