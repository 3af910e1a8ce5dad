// The two per-chunk steps that chunk-wise strategies (seco, spaco, adjoint) are made of. Family-agnostic: the state is
// whatever the model keeps for earlier positions (KV pages, scan states).
#pragma once

#include "core/model.h"
#include "core/strategy.h"

namespace sg {

// Runs chunk c through every layer without keeping activations, appending c's state; with_loss also evaluates
// the LM-head loss of the chunk (no gradient).
HeadResult ForwardChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, bool with_loss);

// What each layer's backward receives: its own cotangent dL/dy_l (exact), or the head's dL/dy_L for every layer
// (adjoint sharding's multi-layer formula as the paper prints it: exact for one layer only).
enum class LayerCotangent { kOwn, kHeadForEveryLayer };

// Recomputes chunk c with its graph and backpropagates loss_scale x (c's token losses) together with the state
// gradient that later chunks relayed into c. Accumulates parameter gradients, relays c's state gradient to the
// earlier positions, then frees c's state.
HeadResult BackpropChunk(Model& m, const Sequence& s, Chunk c, SequenceState& state, double loss_scale,
                         LayerCotangent cotangent = LayerCotangent::kOwn);

// seco's schedule (strategies/seco.cc) over a state sized and configured by `state`; adjoint runs it too.
GradResult SecoSchedule(Model& m, const Sequence& s, double grad_scale, const StrategyOptions& o,
                        const StateOptions& state, LayerCotangent cotangent = LayerCotangent::kOwn);

// Frees the state (and state gradient) of positions >= from in every layer.
void ReleaseFrom(Model& m, SequenceState& state, int64_t from);

}  // namespace sg
