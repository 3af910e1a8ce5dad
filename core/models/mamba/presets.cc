// The Mamba-1 presets.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/models/mamba/mamba.h"

namespace sg {

std::vector<std::string> MambaPresetNames() { return {"tiny-ssm", "bench-ssm", "mamba-2.8b"}; }

absl::StatusOr<MambaConfig> MambaPreset(const std::string& name) {
  MambaConfig c;
  if (name == "tiny-ssm") {
    c.vocab_size = 97;
    c.hidden_size = 16;
    c.state_size = 4;
    c.num_layers = 3;
    c.time_step_rank = 2;
  } else if (name == "bench-ssm") {
    c.vocab_size = 512;
    c.hidden_size = 256;
    c.state_size = 16;
    c.num_layers = 4;
    c.time_step_rank = 16;
  } else if (name == "mamba-2.8b") {
    // state-spaces/mamba-2.8b-hf: vocab_size 50280, hidden_size 2560, num_hidden_layers 64, state_size 16,
    // expand 2 (intermediate_size 5120), conv_kernel 4, time_step_rank 160, use_bias false, use_conv_bias true,
    // layer_norm_epsilon 1e-5, tie_word_embeddings true.
    c.vocab_size = 50280;
    c.hidden_size = 2560;
    c.state_size = 16;
    c.num_layers = 64;
    c.time_step_rank = 160;
  } else {
    return absl::NotFoundError(
        absl::StrCat("'", name, "' is not a Mamba preset (", absl::StrJoin(MambaPresetNames(), ", "), ")"));
  }
  c.intermediate_size = 2 * c.hidden_size;
  c.conv_kernel = 4;
  return c;
}

}  // namespace sg
