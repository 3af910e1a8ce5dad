// The family-agnostic model interface that every strategy schedules: per-layer forward/backward on a chunk of
// tokens carrying a state from earlier tokens (design.md, "the one idea everything rests on").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/tensor.h"
#include "core/loss_sum.h"

namespace sg {

class TokenObjective;  // core/objective.h
struct LoraOptions;    // core/lora.h
struct LoraInfo;
class ModelSpec;  // core/models/family.h

// A contiguous range of token positions [begin, end) of one sequence.
struct Chunk {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// One named parameter with its gradient (the gradient is undefined for frozen parameters).
struct Param {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;
  Tensor grad;  // allocated with the value; undefined for a frozen parameter (LoRA's base)
};

// Activations that one layer keeps from forward_chunk for its backward_chunk.
struct LayerSaved {
  std::vector<Tensor> tensors;
  void Clear() { tensors.clear(); }
};

// How much state a sequence may hold at once: strategies size it so memory is what the schedule needs.
struct StateOptions {
  int64_t seq_len = 0;
  int64_t page_size = 256;
  int resident_layers = 0;       // layers whose cache (KV pages / scan states) is held at once
  int resident_grad_layers = 0;  // layers whose state gradients are held at once
  // SSMs: > 0 computes scan gradients by adjoint sharding over the pairs (t, i) with t - i < adjoint_window, and
  // relays to earlier chunks the cotangents of the next adjoint_window - 1 tokens instead of the state gradient
  // (strategies/adjoint.cc); 0 relays the state gradient (one reverse scan).
  int64_t adjoint_window = 0;
  // Page-level sparse attention (transformers): each query chunk attends, per layer, to the first page, the pages
  // it overlaps plus the one before, and the sparse_pages other earlier pages of highest score (mean query of the
  // chunk . mean key of the page). 0 = dense.
  int64_t sparse_pages = 0;
  // KV offload (transformers, SeCOv2 §4.2, core/kv_offload.h): every layer's KV and KV-gradient pages live in host
  // memory and the device holds a few layers at a time, moved by the device's copy engine alongside compute.
  bool offload = false;
  // Tokens per chunk (the chunked strategies): with offload and sparse pages, the device then holds a number of
  // pages per layer that does not grow with seq_len.
  int64_t chunk = 0;
  // Transformers: attention visits the cache in groups of this many tokens (whole pages, at least one; 0: the
  // default of core/paged_attention.h) and merges the groups' results. Dense offload streams one group of a
  // layer's earlier pages through the device at a time; the walk is the same without offload, so both give the
  // same bits.
  int64_t attention_group = 0;
  // Passes that compute gradients (Training(seed)): random masks (LoRA dropout) are on, drawn from `seed` per
  // position, so every pass over the same sequence draws the same ones. Off otherwise (evaluation).
  bool training = false;
  uint64_t seed = 0;
  // Packed documents (Sequence::doc_starts): where each document starts; empty: one document.
  std::vector<int64_t> doc_starts = {};
  StateOptions Training(uint64_t sequence_seed) const {
    StateOptions o = *this;
    o.training = true;
    o.seed = sequence_seed;
    return o;
  }
  StateOptions Documents(const std::vector<int64_t>& starts) const {
    StateOptions o = *this;
    o.doc_starts = starts;
    return o;
  }
};

// The first position of the document holding `pos` (0 without documents).
int64_t DocumentStart(const std::vector<int64_t>& doc_starts, int64_t pos);
// Chunk c cut where documents start: the pieces in order, each inside one document (c itself without documents).
std::vector<Chunk> SplitAtDocuments(Chunk c, const std::vector<int64_t>& doc_starts);
// Whether position b starts a document (the sequence's start included): no recurrent state crosses b.
bool StartsDocument(const std::vector<int64_t>& doc_starts, int64_t b);
// A piece of a chunk inside one document: its first row in the chunk and its rows; whether it is the chunk's first
// (it reads the chunk's input state) and last (it leaves the output state). Pieces after the first start a document.
struct ChunkPiece {
  int64_t row, rows;
  bool first, last;
};
std::vector<ChunkPiece> DocumentPieces(Chunk c, const std::vector<int64_t>& doc_starts);
// Whether a recurrent layer (an SSM, linear attention) keeps its state after chunk c: a later chunk reads it,
// unless c ends the sequence or a document starts where c ends.
bool KeepsStateAfter(const StateOptions& o, Chunk c);
// t *= factor on its device (a recurrent layer's relayed state gradient); nothing for undefined or meta tensors.
void ScaleTensor(Tensor& t, double factor);

// Tokens of the longest document of a sequence of seq_len positions, counting the final label-only token (the
// engine's inputs are ids[0, n - 1), its labels ids[1, n)) as transformers' position_ids do: the length dynamic
// RoPE scales from; seq_len + 1 without documents.
int64_t LongestDocument(const std::vector<int64_t>& doc_starts, int64_t seq_len);

// State carried along the sequence (KV cache pages for attention, scan states for SSMs) and its gradient.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  // Frees the layer's cache and state gradient for positions >= from (pages that start at or after it).
  virtual void Release(int layer, int64_t from) = 0;
  // Multiplies the layer's state gradient for the positions of c (what later chunks relayed to c) by factor.
  virtual void ScaleGrad(int layer, Chunk c, double factor) = 0;
  // The state gradient of c's positions will never be read (spaco does not backpropagate c): backward may skip
  // computing it. Call before any backward.
  virtual void SkipGrad(Chunk c) {}
  // Adjoint sharding's vector-Jacobian products so far: (t, i) pairs per channel, summed over layers.
  virtual int64_t AdjointPairs() const { return 0; }
  // Host memory holding offloaded state (StateOptions::offload); not counted by the model's MemoryTracker.
  virtual int64_t OffloadedBytes() const { return 0; }
};

struct HeadResult {
  LossSum loss_sum;    // sum of per-token losses over valid labels in the chunk (may be on the device)
  int64_t tokens = 0;  // valid labels in the chunk
  Tensor dh;           // gradient w.r.t. the last layer's output for the chunk (if requested)
};

class Model {
 public:
  virtual ~Model() = default;
  virtual std::string family() const = 0;  // "transformer" or "ssm"
  // The layers whose scan gradient adjoint sharding forms from pairs (t, i) (strategies/adjoint.cc): Mamba's and
  // Mamba-2's. kAll: every layer is a bare scan layer, the paper's model (its --adjoint_form=paper applies); kSome:
  // beside attention or MLPs, whose backward stays seco's.
  enum class ScanLayers { kNone, kSome, kAll };
  virtual ScanLayers scan_layers() const { return ScanLayers::kNone; }
  virtual std::string architecture() const = 0;  // Hugging Face's model_type: "llama", "mamba2", "mamba", ...
  // The configuration the model was created from, as its family describes it (core/models/family.h): its config.json,
  // presets, size, FLOPs, and models like it (other devices, tensor-parallel ranks).
  virtual std::unique_ptr<ModelSpec> spec() const = 0;
  virtual DType dtype() const = 0;
  virtual int num_layers() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t hidden_size() const = 0;
  virtual std::vector<Param>& params() = 0;
  virtual MemoryTracker& memory() = 0;

  virtual std::unique_ptr<SequenceState> NewState(const StateOptions& opts) = 0;

  // x[c] = embedding(ids[c]); backward accumulates into the embedding gradient.
  virtual Tensor Embed(const int32_t* ids, Chunk c) = 0;
  virtual void EmbedBackward(const int32_t* ids, Chunk c, const Tensor& dx) = 0;

  // forward_chunk: y[c] from x[c] and the state of positions < c.begin; appends c's state. Keeps what backward
  // needs in *saved when saved != nullptr.
  virtual Tensor LayerForward(int layer, Chunk c, const Tensor& x, SequenceState& state, LayerSaved* saved) = 0;
  // Only appends c's state of this layer (what later positions read), without computing y[c]: the state-building
  // forward of chunked strategies uses it for the last layer, whose output nothing there needs.
  virtual void LayerAppendState(int layer, Chunk c, const Tensor& x, SequenceState& state) {
    LayerForward(layer, c, x, state, /*saved=*/nullptr);
  }
  // backward_chunk: dx[c] from dy[c]; accumulates parameter gradients and the state gradients of all positions
  // < c.end, and consumes the (complete) state gradient of c itself.
  virtual Tensor LayerBackward(int layer, Chunk c, const Tensor& dy, LayerSaved& saved, SequenceState& state) = 0;

  // Final norm + LM head + the objective on a chunk, computed lm_chunk rows at a time so that at most
  // lm_chunk x vocab logits exist. labels < 0 are ignored. objective null: token cross-entropy; otherwise its
  // Term(t, logp_t) for every labelled position t (in order). With need_grad, accumulates head gradients (scaled
  // by grad_scale) and returns dh.
  virtual HeadResult HeadLoss(Chunk c, const Tensor& h, const int32_t* labels, const TokenObjective* objective,
                              double grad_scale, bool need_grad) = 0;
  virtual void set_lm_chunk(int64_t rows) = 0;

  // Bytes of one token's cache (K and V, or their gradients) summed over the layers that keep one per token (a
  // hybrid's linear and state-space layers keep a fixed-size state instead), for memory planning and reports.
  virtual int64_t StateBytesPerToken() const = 0;

  // Hidden states that a strategy keeps for the whole sequence across layers (ckpt's and streambp's layer inputs)
  // are stored in the activation dtype: bf16 when the model stores its weight matrices in bf16 (DType::kBF16), else
  // dtype(). Layers compute in dtype(): a strategy reads and writes those tensors a chunk at a time through these
  // accessors. Under bf16 every layer's output is already rounded to bf16 values (by the model, whatever the
  // strategy), so storing it loses nothing and every strategy differentiates the same function. Their gradients
  // stay in dtype() (NewGradRows): a strategy keeps two such rows, not one per layer, and rounding them would add
  // error to every parameter gradient below.
  DType activation_dtype();
  // [rows][hidden_size] in the activation dtype (category activations).
  Tensor NewRows(int64_t rows);
  // [rows][hidden_size] in dtype() (category activations), for gradients of hidden states.
  Tensor NewGradRows(int64_t rows);
  // dst's rows c := src ([c.size()][hidden_size] in dtype()), rounded into dst's dtype.
  void StoreRows(Tensor& dst, Chunk c, const Tensor& src);
  // src's rows c in dtype(): a view when src is in dtype(), else a widened copy of those rows only.
  Tensor ReadRows(const Tensor& src, Chunk c);
  // x ([n][hidden_size] in dtype()) as kept for later: x itself when the activation dtype is dtype(), else a copy
  // in the activation dtype.
  Tensor KeepRows(const Tensor& x);

  // A loss term over the whole batch that is not a sum over tokens: a mixture of experts' load-balancing loss over
  // every input token of the batch, in every MoE layer (transformers' output_router_logits). Its gradient needs
  // statistics of the whole batch before any backward, so the trainer runs, per batch: StartBatchStatistics; a
  // forward of every sequence (its last token included, Sequence::last_token); FinishBatchStatistics, which returns
  // the term (added to the batch's loss) and keeps the gradient the backward then adds; the gradient pass; and
  // EndBatchLoss.
  virtual bool HasBatchLoss() const { return false; }
  virtual void StartBatchStatistics() {}
  virtual double FinishBatchStatistics() { return 0; }
  virtual void EndBatchLoss() {}

  // Expert weight offload (core/expert_offload.h, --offload_experts): the frozen expert weights of every MoE layer
  // move to host memory, and a few layers' worth stream through the device. CheckExpertOffload says why a model
  // cannot (no MoE layers, experts that train); OffloadExperts moves them (once: later calls do nothing).
  virtual absl::Status CheckExpertOffload() const {
    return absl::InvalidArgumentError(
        absl::StrCat("--offload_experts: this ", family(), " model has no mixture-of-experts layers"));
  }
  virtual absl::Status OffloadExperts() { return CheckExpertOffload(); }
  // Host memory holding offloaded weights; not counted by the model's MemoryTracker.
  virtual int64_t OffloadedWeightBytes() const { return 0; }

  // LoRA (core/lora.h; use sg::EnableLora): adds adapters to the target modules and freezes the base parameters.
  virtual absl::Status EnableLora(const LoraOptions& options);
  // The adapters; null while LoRA is off.
  virtual const LoraInfo* lora() const { return nullptr; }
};

// Zeroes every defined gradient.
void ZeroGrads(Model& model);

struct InitOptions {
  uint64_t seed = 0;
  double stddev = 0.02;
  // Tests: draw norm weights around 1 and biases around 0 so their gradients are exercised.
  bool perturb_norms_and_biases = false;
  // Models of at most this many parameters draw from one sequential stream; larger ones in parallel (InitRandom).
  int64_t sequential_limit = int64_t{1} << 28;
};

// Random initialisation of any family's parameters (normal(0, stddev) matrices, unit norms, zero biases); a family's
// own parts come after (ModelSpec::InitRandom).
void InitRandom(Model& model, const InitOptions& opts);

// OK when models can be placed on d: CPU always; CUDA when built with --config=cuda and a GPU is usable.
// Otherwise FailedPrecondition saying why (no GPU, built without CUDA).
absl::Status CheckDevice(Device d);
// "cpu" or "cuda" (the --device flag); an error names the flag and the choices.
absl::StatusOr<Device> ParseDevice(const std::string& name);
const char* DeviceName(Device d);

// The dtype a model was created with: bf16 when it stores weight matrices in bf16 (DType::kBF16, whose compute
// dtype Model::dtype() is f32), else its compute dtype.
DType CreatedDType(Model& model);

}  // namespace sg
