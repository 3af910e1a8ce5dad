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
 *    instead of racing. sg_trainer_cancel may be called from any thread at any time.
 *  - Reading parameter/gradient memory (sg_model_param_info views) while a step runs gives torn values.
 *
 * Lifetimes
 *  - A trainer keeps its model alive: sg_model_free() on a model that still has trainers only drops the caller's
 *    reference; the model is destroyed with its last trainer.
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
#define SG_VERSION_MINOR 2
#define SG_VERSION_PATCH 0

/* "MAJOR.MINOR.PATCH" of the loaded library (may differ from the macros of the header you compiled with). */
SG_API const char* sg_version(void);

/* ---- Status ------------------------------------------------------------------------------------------------ */

/* Codes mirror absl::StatusCode where they overlap; SG_ERR_BUSY is seqgrad's own. */
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
/* "weights", "grads", "optimizer", "activations", "kv_cache", "kv_grad", "logits", "workspace"; NULL out of range. */
SG_API const char* sg_memory_category_name(int category);

/* ---- Model --------------------------------------------------------------------------------------------------- */

typedef struct sg_model sg_model;

/* Names of the built-in presets, NULL-terminated static array ("tiny", "tiny-qwen2", "demo", "bench-cpu"). */
SG_API const char* const* sg_model_preset_names(void);

/* A randomly initialised model from a built-in preset. dtype: "f32" or "f64" (NULL = "f32"). */
SG_API sg_status* sg_model_create_preset(const char* preset, const char* dtype, uint64_t seed, sg_model** out);
/* A model from a Hugging Face directory (config.json + model.safetensors[.index.json]). dtype as above. */
SG_API sg_status* sg_model_load(const char* hf_dir, const char* dtype, sg_model** out);
/* Writes config.json + model.safetensors into dir (created if missing). SG_ERR_BUSY while a step runs. */
SG_API sg_status* sg_model_save(sg_model* model, const char* dir);
/* Drops the caller's reference (see Lifetimes). NULL is ignored. */
SG_API void sg_model_free(sg_model* model);

/* Model family: "transformer" (SSM families come later). Static string; "" for NULL. */
SG_API const char* sg_model_family(const sg_model* model);
/* Vocabulary size, number of layers, hidden size, parameter count; -1 for a NULL model. */
SG_API int64_t sg_model_vocab_size(const sg_model* model);
SG_API int64_t sg_model_num_layers(const sg_model* model);
SG_API int64_t sg_model_hidden_size(const sg_model* model);
SG_API int64_t sg_model_num_params(const sg_model* model);
/* Element type of the model's parameters (sg_dtype); -1 for NULL. */
SG_API int sg_model_dtype(const sg_model* model);

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
  const char* strategy; /* "full" | "ckpt" | "seco" | "spaco" (copied; NULL = "full") */
  int64_t chunk;        /* tokens per chunk for chunked strategies (default 512) */
  int64_t page_size;    /* KV page size in tokens (default 256) */
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
} sg_trainer_options;

SG_API sg_trainer_options sg_trainer_default_options(void);

/* A trainer over `model` (which it keeps alive). Validates the options (strategy name, sizes, lr...). */
SG_API sg_status* sg_trainer_create(sg_model* model, const sg_trainer_options* options, sg_trainer** out);
/* NULL is ignored. Must not be called while another thread uses the trainer (undefined). */
SG_API void sg_trainer_free(sg_trainer* trainer);

typedef struct sg_metrics {
  size_t struct_size;
  double loss;       /* mean token loss over the batch */
  int64_t tokens;    /* valid (non -100) labels in the batch */
  double grad_norm;  /* global gradient norm before clipping; 0 when no optimizer step ran */
  int64_t step;      /* optimizer steps taken so far */
  int64_t peak_bytes;/* peak of total engine memory during the call */
  int64_t peak_bytes_by_category[SG_NUM_MEMORY_CATEGORIES];     /* each category's own peak during the call */
  int64_t bytes_at_peak_by_category[SG_NUM_MEMORY_CATEGORIES];  /* the split of peak_bytes */
  double seconds;    /* wall time of the call */
  /* Since 0.2. */
  int64_t chunks;    /* chunks the batch's sequences were split into (full/ckpt: one per sequence) */
  int64_t chunks_backpropagated; /* of which were backpropagated: fewer than chunks only for spaco */
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
 * spaco_budget), SG_ERR_BUSY, SG_ERR_CANCELLED. */
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

/* Called on the stepping thread at the end of every compute_gradients (phase 0) and every step / optimizer_step
 * (phase 1), while the trainer is still marked busy (calls on the same trainer from the callback return
 * SG_ERR_BUSY; sg_trainer_cancel is allowed). fn = NULL removes the callback. Not thread-safe against a running
 * step: set it while the trainer is idle. */
typedef void (*sg_progress_fn)(void* user, const sg_progress* progress);
SG_API sg_status* sg_trainer_set_progress_callback(sg_trainer* trainer, sg_progress_fn fn, void* user);

#ifdef __cplusplus
}
#endif

#endif /* SEQGRAD_SEQGRAD_H_ */
