// seco: sequential chunk-wise optimisation (SeCO, Algorithm 1).
// Stage 1 runs every chunk but the last forward without a graph, keeping only the state (paged KV cache); the
// last chunk's state is needed by no other chunk, and stage 2 computes it first anyway.
// Stage 2 visits chunks in reverse: recompute the chunk with its graph, backprop it, and leave the state
// gradients it produced for earlier positions in the state-gradient pages, where earlier chunks pick them up.
#include "core/strategies/chunk_steps.h"

namespace sg {

GradResult SecoSchedule(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o,
                        const StateOptions& state_options, LayerCotangent cotangent) {
  const std::vector<Chunk> chunks = SplitIntoChunks(static_cast<int64_t>(s.ids.size()), o.chunk);
  auto state = m.NewState(state_options.Documents(s.doc_starts));
  m.set_lm_chunk(o.lm_chunk);

  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    ThrowIfCancelled(o);
    ForwardChunk(m, s, chunks[i], *state, /*with_loss=*/false);
  }

  GradResult result;
  result.chunks = result.chunks_backpropagated = static_cast<int64_t>(chunks.size());
  for (auto c = chunks.rbegin(); c != chunks.rend(); ++c) {
    ThrowIfCancelled(o);
    const HeadResult head = BackpropChunk(m, s, *c, *state, grad_scale, cotangent);
    result.loss_sum += head.loss_sum;
    result.tokens += head.tokens;
  }
  result.adjoint_pairs = state->AdjointPairs();
  result.offloaded_bytes = state->OffloadedBytes();
  return result;
}

GradResult ChunkedBackprop(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o) {
  if (absl::Status valid = ValidateStrategyForModel(o, m); !valid.ok())
    throw std::invalid_argument(std::string(valid.message()));
  const int64_t T = static_cast<int64_t>(s.ids.size());
  const int L = m.num_layers();
  StateOptions state{T,
                     o.page_size,
                     /*resident_layers=*/L,
                     /*resident_grad_layers=*/L,
                     /*adjoint_window=*/0,
                     /*sparse_pages=*/o.sparse_pages};
  state.offload = o.offload;  // the pools then hold a few layers (core/kv_offload.h)
  state.chunk = o.chunk;
  state.attention_group = o.attention_group;
  return SecoSchedule(m, s, grad_scale, o, state.Training(o.seed));
}

}  // namespace sg
