// The two per-chunk steps that chunk-wise strategies (seco, spaco) are made of. Family-agnostic: the state is
// whatever the model keeps for earlier positions (KV pages, scan states).
#pragma once

#include "core/model.h"
#include "core/strategy.h"

namespace sg {

// Runs chunk c through every layer without keeping activations, appending c's state; with_loss also evaluates
// the LM-head loss of the chunk (no gradient).
HeadResult ForwardChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, bool with_loss);

// Recomputes chunk c with its graph and backpropagates loss_scale x (c's token losses) together with the state
// gradient that later chunks relayed into c. Accumulates parameter gradients, relays c's state gradient to the
// earlier positions, then frees c's state.
HeadResult BackpropChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, double loss_scale);

// Frees the state (and state gradient) of positions >= from in every layer.
void ReleaseFrom(Model& m, SequenceState& state, int64_t from);

}  // namespace sg
