// `bench --census`: the roofline census of one training step per (strategy, sequence length), counted on the meta
// device (core/census.h) whatever --device says: per kernel family the calls, FLOPs, bytes and time at an H100's
// limits, and the step's upper bound on MFU. A model of the CUDA backend's work, not a measurement.
#pragma once

#include <string>

namespace sg::tools {

// strategies and seq_lens: bench's comma-separated lists; json_path: where to write the census as JSON ("" = no
// file). The model, dtype and strategy options come from the shared flags (--model, --dtype, --chunk, ...).
// Returns the exit code.
int CensusMain(const std::string& strategies, const std::string& seq_lens, const std::string& json_path);

}  // namespace sg::tools
