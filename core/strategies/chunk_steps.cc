#include "core/strategies/chunk_steps.h"

#include <vector>

namespace sg {

HeadResult ForwardChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, bool with_loss) {
  const int L = m.num_layers();
  Tensor x = m.Embed(s.ids.data(), c);
  for (int l = 0; l < L - 1; ++l) x = m.LayerForward(l, c, x, state, /*saved=*/nullptr);
  if (!with_loss) {  // nothing reads the last layer's output: build its state only
    m.LayerAppendState(L - 1, c, x, state);
    return {};
  }
  x = m.LayerForward(L - 1, c, x, state, /*saved=*/nullptr);
  return m.HeadLoss(c, x, s.labels.data(), s.objective.get(), /*grad_scale=*/0, /*need_grad=*/false);
}

HeadResult BackpropChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, double loss_scale,
                         LayerCotangent cotangent) {
  const int L = m.num_layers();
  std::vector<LayerSaved> saved(L);
  Tensor x = m.Embed(s.ids.data(), c);
  for (int l = 0; l < L; ++l) x = m.LayerForward(l, c, x, state, &saved[l]);
  HeadResult head = m.HeadLoss(c, x, s.labels.data(), s.objective.get(), loss_scale, /*need_grad=*/true);
  x.Reset();

  Tensor dx = std::move(head.dh);
  const Tensor top = cotangent == LayerCotangent::kOwn ? Tensor() : dx;
  for (int l = L - 1; l >= 0; --l) {
    dx = m.LayerBackward(l, c, cotangent == LayerCotangent::kOwn ? dx : top, saved[l], state);
    saved[l].Clear();
  }
  m.EmbedBackward(s.ids.data(), c, dx);
  ReleaseFrom(m, state, c.begin);
  return head;
}

GradResult EvaluateLoss(Model& m, const Sequence& s, const StrategyOptions& o) {
  const int64_t T = static_cast<int64_t>(s.ids.size());
  auto state =
      m.NewState(StateOptions{T, o.page_size, /*resident_layers=*/m.num_layers(), /*resident_grad_layers=*/0}.Documents(
          s.doc_starts));
  m.set_lm_chunk(o.lm_chunk);
  GradResult result;
  result.chunks = result.chunks_backpropagated = 0;
  for (const Chunk& c : SplitIntoChunks(T, o.chunk)) {
    ThrowIfCancelled(o);
    const HeadResult head = ForwardChunk(m, s, c, *state, /*with_loss=*/true);
    result.loss_sum += head.loss_sum;
    result.tokens += head.tokens;
    ++result.chunks;
  }
  return result;
}

void ReleaseFrom(Model& m, SequenceState& state, int64_t from) {
  for (int l = 0; l < m.num_layers(); ++l) state.Release(l, from);
}

}  // namespace sg
