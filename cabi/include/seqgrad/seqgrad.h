/* seqgrad C API: a stable C99 interface to the seqgrad training engine.
 *
 * Conventions
 *  - Opaque handles (sg_model, sg_trainer, sg_status); functions are named sg_<object>_<verb>.
 *  - Every fallible function returns sg_status*: NULL means success. A non-NULL status is owned by the caller,
 *    who reads it with sg_status_code()/sg_status_message() and frees it with sg_status_free().
 *    C++ exceptions never cross this boundary.
 *  - Every *_free function accepts NULL. Using a handle after it was freed is undefined behaviour (it cannot be
 *    detected); passing a NULL handle or a NULL required pointer returns SG_ERR_INVALID_ARGUMENT naming it.
 *  - Option structs come from sg_*_default_options() and start with `size_t struct_size`. New fields are only ever
 *    appended (marked "since x.y"). The library accepts the size of any published version of a struct, so a program
 *    built against an older header keeps working (fields it did not have take their defaults), and any size larger
 *    than its own, so a newer program runs on an older library (fields it does not know are ignored); other sizes
 *    are rejected with SG_ERR_INVALID_ARGUMENT.
 *    Output structs (sg_metrics, sg_param_info) also start with struct_size, set by the caller through
 *    sg_metrics_init()/sg_param_info_init(), with the same sizes accepted; the library fills only the fields that fit.
 *
 * Thread safety
 *  - Different handles may be used from different threads at once.
 *  - A trainer runs one step at a time: a second concurrent sg_trainer_step/compute_gradients/optimizer_step on the
 *    same trainer (or on another trainer of the same model, or sg_model_save of that model) returns SG_ERR_BUSY
 *    instead of racing; a dpo/grpo step also holds its reference model (sg_trainer_set_reference) the same way.
 *    sg_trainer_cancel may be called from any thread at any time.
 *  - Reading parameter/gradient memory (sg_model_param_info views) while a step runs gives torn values.
 *
 * Lifetimes
 *  - A trainer keeps its model (and its reference model, sg_trainer_set_reference) alive: sg_model_free() on a model
 *    that still has trainers only drops the caller's reference; the model is destroyed with its last trainer.
 *  - Pointers returned inside sg_param_info (name, data, grad) stay valid until the model is destroyed.
 *  - Strings returned by sg_version(), sg_memory_category_name(), sg_dtype_name() are static.
 */
#ifndef SEQGRAD_SEQGRAD_H_
#define SEQGRAD_SEQGRAD_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define SG_API __declspec(dllexport)
#else
#define SG_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SG_VERSION_MAJOR 0
#define SG_VERSION_MINOR 4
#define SG_VERSION_PATCH 0

/* "MAJOR.MINOR.PATCH" of the loaded library (may differ from the macros of the header you compiled with). */
SG_API const char* sg_version(void);

/* ---- Status ------------------------------------------------------------------------------------------------ */

/* Codes mirror absl::StatusCode where they overlap; SG_ERR_BUSY is seqgrad's own. SG_ERR_RESOURCE_EXHAUSTED: out of
 * memory, or a step that would pass the model's memory limit (sg_model_set_memory_limit). */
typedef enum sg_code {
  SG_OK = 0,
  SG_ERR_CANCELLED = 1,
  SG_ERR_UNKNOWN = 2,
  SG_ERR_INVALID_ARGUMENT = 3,
  SG_ERR_DEADLINE_EXCEEDED = 4,
  SG_ERR_NOT_FOUND = 5,
  SG_ERR_ALREADY_EXISTS = 6,
  SG_ERR_PERMISSION_DENIED = 7,
  SG_ERR_RESOURCE_EXHAUSTED = 8,
  SG_ERR_FAILED_PRECONDITION = 9,
  SG_ERR_ABORTED = 10,
  SG_ERR_OUT_OF_RANGE = 11,
  SG_ERR_UNIMPLEMENTED = 12,
  SG_ERR_INTERNAL = 13,
  SG_ERR_UNAVAILABLE = 14,
  SG_ERR_DATA_LOSS = 15,
  SG_ERR_UNAUTHENTICATED = 16,
  SG_ERR_BUSY = 100 /* the trainer/model is in use by another thread */
} sg_code;

typedef struct sg_status sg_status;

/* Code of a status; SG_OK for NULL. */
SG_API int sg_status_code(const sg_status* status);
/* Message of a status (valid until sg_status_free); "" for NULL. */
SG_API const char* sg_status_message(const sg_status* status);
SG_API void sg_status_free(sg_status* status);
/* Name of a code, e.g. "INVALID_ARGUMENT"; "UNKNOWN_CODE" for values not listed above. */
SG_API const char* sg_code_name(int code);

/* ---- Types --------------------------------------------------------------------------------------------------- */

typedef enum sg_dtype {
  SG_DTYPE_F32 = 0,
  SG_DTYPE_F64 = 1,
  SG_DTYPE_BF16 = 2,
  SG_DTYPE_F16 = 3,
  SG_DTYPE_I32 = 4,
  SG_DTYPE_I64 = 5
} sg_dtype;

/* "f32", "f64", ...; NULL for unknown values. */
SG_API const char* sg_dtype_name(int dtype);

/* Memory categories of the engine's allocator, in this order. */
#define SG_NUM_MEMORY_CATEGORIES 8
/* "weights", "grads", "optimizer", "activations", "kv_cache", "kv_grad", "logits", "workspace"; NULL out of range.
 * "kv_cache"/"kv_grad" hold each model's sequence state and its gradient: the KV cache of a transformer, the scan
 * state and conv tail at chunk boundaries of an SSM. */
SG_API const char* sg_memory_category_name(int category);

/* ---- Model --------------------------------------------------------------------------------------------------- */

typedef struct sg_model sg_model;

/* Names of the built-in presets of every family, NULL-terminated static array: transformers ("tiny",
 * "tiny-qwen2", "demo", "bench-cpu"), then Mamba-1 SSMs ("tiny-ssm", "bench-ssm"; since 0.3). */
SG_API const char* const* sg_model_preset_names(void);

/* A randomly initialised model (any family) from a built-in preset. dtype: "f32" or "f64" (NULL = "f32"). */
SG_API sg_status* sg_model_create_preset(const char* preset, const char* dtype, uint64_t seed, sg_model** out);
/* A model from a Hugging Face directory (config.json + model.safetensors[.index.json]) whose config.json
 * model_type is "llama", "qwen2" or (since 0.3) "mamba" (MambaForCausalLM). dtype as above. */
SG_API sg_status* sg_model_load(const char* hf_dir, const char* dtype, sg_model** out);
/* Writes config.json + model.safetensors into dir (created if missing), for either family, loadable by
 * sg_model_load and by Hugging Face transformers. SG_ERR_BUSY while a step runs. */
SG_API sg_status* sg_model_save(sg_model* model, const char* dir);
/* Drops the caller's reference (see Lifetimes). NULL is ignored. */
SG_API void sg_model_free(sg_model* model);

/* Model family: "transformer" (Llama/Qwen2) or "ssm" (Mamba-1; since 0.3). Static string; "" for NULL. */
SG_API const char* sg_model_family(const sg_model* model);
/* Vocabulary size, number of layers, hidden size, parameter count; -1 for a NULL model. */
SG_API int64_t sg_model_vocab_size(const sg_model* model);
SG_API int64_t sg_model_num_layers(const sg_model* model);
SG_API int64_t sg_model_hidden_size(const sg_model* model);
SG_API int64_t sg_model_num_params(const sg_model* model);
/* Element type of the model's parameters (sg_dtype); -1 for NULL. */
SG_API int sg_model_dtype(const sg_model* model);

/* Since 0.3. Caps the engine memory the model's tensors may hold at once (weights included, as counted in
 * sg_metrics.peak_bytes), in bytes; 0 = no cap (the default). A step (of any trainer of this model, or a reference
 * log-prob pass on it) that would need more stops with SG_ERR_RESOURCE_EXHAUSTED ("memory limit of N bytes exceeded:
 * ...") instead of allocating, and leaves the model and its trainers usable (gradients are then incomplete: compute
 * them again before an optimizer step). The first optimizer step of a trainer allocates AdamW's two moments per
 * parameter, checked against the limit before any of them is allocated. Errors: SG_ERR_INVALID_ARGUMENT (NULL model,
 * bytes < 0), SG_ERR_BUSY while a step uses the model. */
SG_API sg_status* sg_model_set_memory_limit(sg_model* model, int64_t bytes);
/* Since 0.3. The memory limit in bytes (0 = none); -1 for NULL. */
SG_API int64_t sg_model_memory_limit(const sg_model* model);

#define SG_MAX_DIMS 8

/* A zero-copy view of one parameter and its gradient (row-major, contiguous). */
typedef struct sg_param_info {
  size_t struct_size;
  const char* name; /* Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight" */
  int dtype;        /* sg_dtype */
  int ndim;
  int64_t shape[SG_MAX_DIMS];
  int64_t numel;
  void* data; /* the parameter's values; writable */
  void* grad; /* its gradient, NULL for frozen parameters; valid after a compute_gradients/step */
} sg_param_info;

/* A zeroed sg_param_info with struct_size set. */
SG_API sg_param_info sg_param_info_init(void);
/* Parameter `index` in [0, sg_model_num_params). out->struct_size must be set (sg_param_info_init). */
SG_API sg_status* sg_model_param_info(const sg_model* model, int64_t index, sg_param_info* out);

/* ---- Trainer ------------------------------------------------------------------------------------------------- */

typedef struct sg_trainer sg_trainer;

typedef struct sg_trainer_options {
  size_t struct_size;   /* sizeof(sg_trainer_options) of the header the caller compiled with */
  const char* strategy; /* "full" | "ckpt" | "seco" | "spaco" | "streambp" (since 0.3) | "adjoint" (since 0.4; SSM
                           models only: SG_ERR_INVALID_ARGUMENT on a transformer) (copied; NULL = "full") */
  int64_t chunk;        /* tokens per chunk for chunked strategies (seco, spaco), per partition inside a layer for
                           streambp (default 512) */
  int64_t page_size;    /* KV page size in tokens (default 256; transformers only, ignored by SSMs) */
  int64_t lm_chunk;     /* LM-head rows at a time (default 256) */
  double lr;            /* AdamW learning rate (default 1e-3) */
  double beta1;         /* default 0.9 */
  double beta2;         /* default 0.95 */
  double eps;           /* default 1e-8 */
  double weight_decay;  /* default 0 (never applied to norms and biases) */
  double clip_grad_norm;/* global-norm clipping, 0 = none (default 1.0) */
  uint64_t reserved[16];/* must be zero; room for later options without changing the size */
  /* Since 0.2: spaco keeps each of a sequence's k chunks with probability spaco_budget / k and compensates the
   * kept ones so that the gradient estimate stays unbiased. */
  int64_t spaco_budget; /* chunks backpropagated per sequence on average; in [1, k] for every sequence (default 8) */
  double spaco_cap;     /* cap on the compensation of relayed state gradients, trading bias for lower variance:
                           0 = no cap (exactly unbiased), else >= 1 (default 2) */
  uint64_t seed;        /* spaco sampling seed; every compute_gradients call and sequence derives its own (default 0) */
  /* Since 0.3: the training objective, fixed for the trainer's lifetime. "sft" trains with sg_trainer_step /
   * compute_gradients, "dpo" with sg_trainer_step_dpo / compute_gradients_dpo, "grpo" with sg_trainer_step_grpo /
   * compute_gradients_grpo; the other family of calls returns SG_ERR_FAILED_PRECONDITION. */
  const char* objective; /* "sft" | "dpo" | "grpo" (copied; NULL = "sft") */
  double dpo_beta;       /* dpo: L = -log sigmoid(dpo_beta ((pi_c - ref_c) - (pi_r - ref_r))) per pair; > 0
                            (default 0.1) */
  double grpo_clip_eps;  /* grpo: the ratio r_t = exp(logp_t - old_t) is clipped to [1 - eps, 1 + eps]; in (0, 1)
                            (default 0.2) */
  double grpo_kl_beta;   /* grpo: weight of the k3 KL penalty to the reference (e^x - x - 1, x = ref_t - logp_t); >= 0,
                            0 = no penalty and no reference needed (default 0.04) */
  /* Since 0.4: strategy "adjoint" (adjoint sharding for state-space models): each layer's scan gradient as independent
   * vector-Jacobian products over the pairs (t, i), i <= t, with exact per-layer cotangents; chunks of `chunk`
   * tokens. Both fields are checked whatever the strategy and used only by "adjoint". */
  const char* adjoint_form; /* "pairs" (adjoint sharding over (t, i) pairs) | "scan" (one reverse scan per chunk, the
                               cheap exact form; takes no window) | "paper" (the paper's multi-layer formula, exact for
                               one layer only) (copied; NULL = "pairs") */
  int64_t adjoint_window;   /* truncation: only the pairs with t - i < adjoint_window (pairs, paper), i.e.
                               w T - w (w - 1) / 2 pairs per layer and channel for a sequence of T tokens instead of
                               T (T + 1) / 2; must be > 0; INT64_MAX = no truncation (the default); "scan" needs
                               INT64_MAX */
} sg_trainer_options;

SG_API sg_trainer_options sg_trainer_default_options(void);

/* A trainer over `model` (which it keeps alive). Validates the options (strategy and objective names, sizes, lr...)
 * and that the strategy suits the model's family ("adjoint": SSMs only); errors are SG_ERR_INVALID_ARGUMENT naming
 * the option. */
SG_API sg_status* sg_trainer_create(sg_model* model, const sg_trainer_options* options, sg_trainer** out);
/* NULL is ignored. Must not be called while another thread uses the trainer (undefined). */
SG_API void sg_trainer_free(sg_trainer* trainer);

typedef struct sg_metrics {
  size_t struct_size;
  double loss;       /* mean token loss over the batch; dpo: mean over pairs of -log sigmoid(z); grpo: the objective */
  int64_t tokens;    /* valid (non -100) labels in the batch (dpo, grpo: over all of its sequences) */
  double grad_norm;  /* global gradient norm before clipping; 0 when no optimizer step ran */
  int64_t step;      /* optimizer steps taken so far */
  int64_t peak_bytes;/* peak of total engine memory during the call */
  int64_t peak_bytes_by_category[SG_NUM_MEMORY_CATEGORIES];     /* each category's own peak during the call */
  int64_t bytes_at_peak_by_category[SG_NUM_MEMORY_CATEGORIES];  /* the split of peak_bytes */
  double seconds;    /* wall time of the call */
  /* Since 0.2. */
  int64_t chunks;    /* chunks the batch's sequences were split into (full/ckpt: one per sequence) */
  int64_t chunks_backpropagated; /* of which were backpropagated: fewer than chunks only for spaco */
  /* Since 0.4. */
  int64_t adjoint_pairs; /* strategy "adjoint" (forms pairs, paper): the vector-Jacobian products (t, i) per channel,
                            summed over layers and sequences; 0 for the other strategies and for sg_trainer_evaluate */
} sg_metrics;

/* A zeroed sg_metrics with struct_size set. */
SG_API sg_metrics sg_metrics_init(void);

/* Gradients of the mean token loss of a batch (gradients are zeroed first).
 *   ids:        num_tokens token ids, the sequences concatenated
 *   labels:     num_tokens targets aligned with ids (-100 = ignored), or NULL for next-token labels
 *               (labels[i] = ids[i+1] within each sequence, the last position ignored)
 *   lengths:    num_sequences lengths (each >= 1) summing to num_tokens
 *   out:        NULL or metrics with struct_size set
 * Errors: SG_ERR_INVALID_ARGUMENT (names the argument; for spaco also a sequence with fewer chunks than
 * spaco_budget), SG_ERR_BUSY, SG_ERR_CANCELLED, SG_ERR_RESOURCE_EXHAUSTED (the model's memory limit),
 * SG_ERR_FAILED_PRECONDITION (the trainer's objective is not "sft"). */
SG_API sg_status* sg_trainer_compute_gradients(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                               int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                               sg_metrics* out);
/* compute_gradients, then clipping + AdamW. */
SG_API sg_status* sg_trainer_step(sg_trainer* trainer, const int32_t* ids, const int32_t* labels, int64_t num_tokens,
                                  const int64_t* lengths, int64_t num_sequences, sg_metrics* out);
/* Clipping + AdamW with the gradients held now; out (may be NULL) gets loss/tokens/chunks of the last
 * compute_gradients. */
SG_API sg_status* sg_trainer_optimizer_step(sg_trainer* trainer, sg_metrics* out);
/* Optimizer steps taken so far; -1 for NULL. */
SG_API int64_t sg_trainer_step_count(const sg_trainer* trainer);

/* Since 0.3. The mean token loss (cross-entropy) of a batch without gradients, by a chunked forward pass (chunks of
 * options.chunk tokens); the batch as in sg_trainer_compute_gradients. Any objective. Gradients, the optimizer and the
 * progress callback are left alone; out gets loss, tokens, chunks (chunks_backpropagated = 0, grad_norm = 0), step,
 * memory and seconds. Errors as sg_trainer_compute_gradients (no SG_ERR_FAILED_PRECONDITION). */
SG_API sg_status* sg_trainer_evaluate(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                      int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                      sg_metrics* out);

/* ---- Preference and RL objectives (since 0.3) ------------------------------------------------------------------
 *
 * Sequences are given one array each (arrays of pointers, with their lengths): ids[i] points to lengths[i] token ids
 * (prompt + response), labels[i] to lengths[i] targets aligned with them (labels[i][t] = the token that follows
 * position t, -100 = ignored: label the response only). A NULL labels array, or a NULL labels[i], means next-token
 * labels over the whole sequence. Every sequence needs >= 1 labelled token. The library copies what it reads; the
 * arrays may be reused once the call returns. */

/* The frozen reference model of dpo/grpo, used where the batch carries no reference log-probs; NULL clears it.
 * The trainer keeps the reference alive (sg_model_free on it only drops the caller's reference). It must have the
 * vocabulary of the trainer's model and be another model (not the trainer's own: load or create the same weights
 * again for a frozen copy). While a dpo/grpo step runs, the reference counts as in use: calls on it from other threads
 * (a trainer of it, sg_model_save, sg_model_set_memory_limit) return SG_ERR_BUSY, and a dpo/grpo step whose reference
 * is in use returns SG_ERR_BUSY. Its memory is counted (and limited) by the reference model, not in the trainer's
 * sg_metrics. Errors: SG_ERR_INVALID_ARGUMENT (NULL trainer, another vocabulary, the trainer's own model),
 * SG_ERR_BUSY while the trainer steps. */
SG_API sg_status* sg_trainer_set_reference(sg_trainer* trainer, sg_model* reference);

/* DPO on num_pairs >= 1 preference pairs (trainer objective "dpo"): gradients of the mean over pairs of
 * -log sigmoid(dpo_beta ((pi_c - ref_c) - (pi_r - ref_r))), where pi_c, pi_r are the summed log-probs of the
 * labelled tokens of the chosen / rejected sequence under the trainer's model and ref_c, ref_r the same under the
 * reference. Gradients are zeroed first.
 *   chosen_ids, chosen_labels, chosen_lengths:       pair i's chosen sequence (see above; chosen_labels may be NULL)
 *   rejected_ids, rejected_labels, rejected_lengths: pair i's rejected sequence
 *   ref_chosen_logp, ref_rejected_logp: NULL or num_pairs reference log-probs, each summed over the sequence's
 *                    labelled tokens; NULL or a NaN entry: computed by the reference model
 *                    (sg_trainer_set_reference), which then must be set
 *   out:             NULL or metrics with struct_size set
 * Errors: SG_ERR_INVALID_ARGUMENT (names the argument and the pair), SG_ERR_FAILED_PRECONDITION (the trainer's
 * objective is not "dpo"), SG_ERR_BUSY, SG_ERR_CANCELLED, SG_ERR_RESOURCE_EXHAUSTED. */
SG_API sg_status* sg_trainer_compute_gradients_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                                   const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                                                   const int32_t* const* rejected_ids,
                                                   const int32_t* const* rejected_labels,
                                                   const int64_t* rejected_lengths, const double* ref_chosen_logp,
                                                   const double* ref_rejected_logp, int64_t num_pairs,
                                                   sg_metrics* out);
/* compute_gradients_dpo, then clipping + AdamW. */
SG_API sg_status* sg_trainer_step_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                      const int32_t* const* chosen_labels, const int64_t* chosen_lengths,
                                      const int32_t* const* rejected_ids, const int32_t* const* rejected_labels,
                                      const int64_t* rejected_lengths, const double* ref_chosen_logp,
                                      const double* ref_rejected_logp, int64_t num_pairs, sg_metrics* out);

/* GRPO on num_groups >= 1 groups of completions (trainer objective "grpo"): gradients of
 *   sum over groups, completions i, labelled t of (-min(r_t A_i, clip(r_t, 1 - eps, 1 + eps) A_i)
 *                                                  + grpo_kl_beta k3(ref_t - logp_t)) / (|o_i| G B),
 * r_t = exp(logp_t - old_t), |o_i| the labelled tokens of completion i, G its group's size, B = num_groups.
 * Gradients are zeroed first. Completions form one list of num_completions >= 1; group g holds completions
 * [group_offsets[g], group_offsets[g + 1]):
 *   ids, labels, lengths: completion c's sequence, prompt + completion (see above; labels may be NULL)
 *   advantages:     num_completions finite advantages A_c
 *   old_logprobs:   NULL, or num_completions pointers, each NULL or lengths[c] log-probs of the labels under the
 *                   policy that sampled the completion, aligned with labels
 *                   (old_logprobs[c][t] = log p_old(labels[c][t] | position t)); finite where the label is valid,
 *                   anything (e.g. NaN) where it is -100.
 *                   NULL: old = the current policy (r_t = 1)
 *   ref_logprobs:   the same for the reference policy; NULL: computed by the reference model
 *                   (sg_trainer_set_reference), which then must be set unless grpo_kl_beta = 0
 *   group_offsets:  num_groups + 1 offsets, group_offsets[0] = 0, strictly increasing (G >= 1 in every group),
 *                   group_offsets[num_groups] = num_completions
 * Errors: SG_ERR_INVALID_ARGUMENT (names the argument, the group and the completion), SG_ERR_FAILED_PRECONDITION
 * (the trainer's objective is not "grpo"), SG_ERR_BUSY, SG_ERR_CANCELLED, SG_ERR_RESOURCE_EXHAUSTED. */
SG_API sg_status* sg_trainer_compute_gradients_grpo(sg_trainer* trainer, const int32_t* const* ids,
                                                    const int32_t* const* labels, const int64_t* lengths,
                                                    const double* advantages, const double* const* old_logprobs,
                                                    const double* const* ref_logprobs, int64_t num_completions,
                                                    const int64_t* group_offsets, int64_t num_groups,
                                                    sg_metrics* out);
/* compute_gradients_grpo, then clipping + AdamW. */
SG_API sg_status* sg_trainer_step_grpo(sg_trainer* trainer, const int32_t* const* ids, const int32_t* const* labels,
                                       const int64_t* lengths, const double* advantages,
                                       const double* const* old_logprobs, const double* const* ref_logprobs,
                                       int64_t num_completions, const int64_t* group_offsets, int64_t num_groups,
                                       sg_metrics* out);

/* Asks the running step to stop (thread-safe, async-signal-safe). The running step returns SG_ERR_CANCELLED; if
 * none is running, the next one does. The request is consumed by the step that reports it. NULL is ignored. */
SG_API void sg_trainer_cancel(sg_trainer* trainer);

typedef struct sg_progress {
  size_t struct_size;
  int64_t step;     /* optimizer steps so far (after this call's step, if any) */
  double loss;      /* mean token loss of the batch */
  int64_t tokens;   /* valid labels of the batch */
  double grad_norm; /* 0 until an optimizer step ran in this call */
  int phase;        /* 0 = gradients computed, 1 = optimizer step done */
} sg_progress;

/* Called on the stepping thread at the end of every compute_gradients* (phase 0) and every step* / optimizer_step
 * (phase 1) (not for sg_trainer_evaluate), while the trainer is still marked busy (calls on the same trainer from the
 * callback return SG_ERR_BUSY; sg_trainer_cancel is allowed). fn = NULL removes the callback. Not thread-safe against
 * a running step: set it while the trainer is idle. */
typedef void (*sg_progress_fn)(void* user, const sg_progress* progress);
SG_API sg_status* sg_trainer_set_progress_callback(sg_trainer* trainer, sg_progress_fn fn, void* user);

#ifdef __cplusplus
}
#endif

#endif /* SEQGRAD_SEQGRAD_H_ */
