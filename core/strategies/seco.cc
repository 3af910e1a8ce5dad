// seco: sequential chunk-wise optimisation (SeCO, Algorithm 1).
// Stage 1 runs every chunk forward without a graph, keeping only the state (paged KV cache).
// Stage 2 visits chunks in reverse: recompute the chunk with its graph, backprop it, and leave the state
// gradients it produced for earlier positions in the state-gradient pages, where earlier chunks pick them up.
#include "core/strategy.h"

namespace sg {

GradResult ChunkedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  const std::vector<Chunk> chunks = SplitIntoChunks(T, o.chunk);
  auto state = m.NewState({T, o.page_size, /*resident_layers=*/L, /*resident_grad_layers=*/L});
  m.set_lm_chunk(o.lm_chunk);

  for (const Chunk& c : chunks) {
    ThrowIfCancelled(o);
    Tensor x = m.Embed(s.ids.data(), c);
    for (int l = 0; l < L; ++l) x = m.LayerForward(l, c, x, *state, /*saved=*/nullptr);
  }

  GradResult result;
  std::vector<LayerSaved> saved(L);
  for (auto c = chunks.rbegin(); c != chunks.rend(); ++c) {
    ThrowIfCancelled(o);
    Tensor x = m.Embed(s.ids.data(), *c);
    for (int l = 0; l < L; ++l) x = m.LayerForward(l, *c, x, *state, &saved[l]);
    HeadResult head = m.HeadLoss(*c, x, s.labels.data(), grad_scale, /*need_grad=*/true);
    x.Reset();
    result.loss_sum += head.loss_sum;
    result.tokens += head.tokens;

    Tensor dx = std::move(head.dh);
    for (int l = L - 1; l >= 0; --l) {
      dx = m.LayerBackward(l, *c, dx, saved[l], *state);
      saved[l].Clear();
    }
    m.EmbedBackward(s.ids.data(), *c, dx);
    for (int l = 0; l < L; ++l) state->Release(l, c->begin);
  }
  return result;
}

}  // namespace sg
