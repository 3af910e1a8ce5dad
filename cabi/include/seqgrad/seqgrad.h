/* seqgrad C API: a stable C99 interface to the seqgrad training engine.
 *
 * Conventions
 *  - Opaque handles (sg_model, sg_trainer, sg_status); functions are named sg_<object>_<verb>.
 *  - Every fallible function returns sg_status*: NULL means success. A non-NULL status is owned by the caller,
 *    who reads it with sg_status_code()/sg_status_message() and frees it with sg_status_free().
 *    C++ exceptions never cross this boundary.
 *  - A failed system call (saving, loading, reading data) gives the code its errno maps to, the same in every
 *    function: ENOENT SG_ERR_NOT_FOUND, EACCES/EPERM/EROFS SG_ERR_PERMISSION_DENIED, ENOTDIR/EISDIR
 *    SG_ERR_FAILED_PRECONDITION, ENOSPC/EDQUOT SG_ERR_RESOURCE_EXHAUSTED, EEXIST SG_ERR_ALREADY_EXISTS, EIO
 *    SG_ERR_UNKNOWN (absl::ErrnoToStatusCode); its message names the path and ends with strerror's text.
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
 *    The same holds for the 0.5 calls: accumulate_gradients*, evaluate_detailed, save/load_checkpoint, resume, and
 *    the model's LoRA calls (sg_model_enable_lora, sg_model_save/load_lora_adapter).
 *    sg_trainer_cancel may be called from any thread at any time.
 *  - Reading parameter/gradient memory (sg_model_param_info views) while a step runs gives torn values.
 *
 * Lifetimes
 *  - A trainer keeps its model (and its reference model, sg_trainer_set_reference) alive: sg_model_free() on a model
 *    that still has trainers only drops the caller's reference; the model is destroyed with its last trainer.
 *  - Pointers returned inside sg_param_info (name, data, grad) stay valid until the model is destroyed, except that
 *    enabling LoRA (sg_model_enable_lora, or sg_model_load_lora_adapter on a model without LoRA) adds parameters and
 *    releases the base parameters' gradients: name and grad pointers obtained before it are invalid after it (data
 *    pointers stay valid). Enable LoRA right after creating or loading the model.
 *  - Strings returned by sg_version(), sg_memory_category_name(), sg_dtype_name() are static.
 *
 * Labels (since 0.7: Hugging Face's convention)
 *  - Labels are aligned with the input ids and shifted by the library, as in Hugging Face transformers: labels[t] is
 *    the token at position t (-100 = ignored), position t is trained to predict labels[t + 1], so labels[0] is never
 *    predicted; NULL labels mean next-token labels (labels = ids). This holds for every call that takes labels, per
 *    sequence (each sequence of a packed batch is shifted on its own). Before 0.7 the C API took labels already
 *    shifted (labels[t] = the target of position t): pass the same arrays with one leading -100 less, or ids.
 *  - Per-token outputs and inputs (sg_trainer_score's log-probs, grpo's old/ref log-probs, evaluate_detailed's
 *    distances) are aligned the same way: entry t belongs to labels[t].
 *
 * Threads
 *  - The engine parallelises with OpenMP (and OpenBLAS's OpenMP build). sg_trainer_options.num_threads (since 0.7)
 *    sets the thread count of a trainer's calls on the calling thread (omp_set_num_threads + openblas_set_num_threads
 *    around each call, restored after it); 0 keeps the caller's (OMP_NUM_THREADS, else one per core).
 *  - On a machine shared with other processes, set OMP_WAIT_POLICY=PASSIVE in the environment of a program that
 *    embeds the library before it starts (libgomp reads it once, at load): with the default spin-waiting, idle
 *    OpenMP threads keep cores busy between parallel regions and a step can be many times slower when another
 *    process competes for the CPU. The command-line tools set it themselves unless the user did.
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

/* SG_VERSION_MAJOR, SG_VERSION_MINOR, SG_VERSION_PATCH and SG_VERSION_STRING of this header. */
#include "seqgrad/version.h"

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

/* Memory categories of the engine's allocator, in this order: the SG_NUM_MEMORY_CATEGORIES of sg_metrics'
 * per-category arrays (fixed since 0.1), then the categories added later, which sg_metrics reports in fields of
 * their own; SG_NUM_MEMORY_CATEGORIES_ALL in all. */
#define SG_NUM_MEMORY_CATEGORIES 8
/* Since 0.7: fp32 master copies of trainable bf16 weights (dtype "bf16"; the AdamW moments are "optimizer"). */
#define SG_MEMORY_CATEGORY_MASTER_WEIGHTS 8
#define SG_NUM_MEMORY_CATEGORIES_ALL 9
/* "weights", "grads", "optimizer", "activations", "kv_cache", "kv_grad", "logits", "workspace", then (since 0.7)
 * "master_weights"; NULL out of range.
 * "kv_cache"/"kv_grad" hold each model's sequence state and its gradient: the KV cache of a transformer, the scan
 * state and conv tail at chunk boundaries of an SSM. */
SG_API const char* sg_memory_category_name(int category);

/* ---- Model --------------------------------------------------------------------------------------------------- */

typedef struct sg_model sg_model;

/* Names of the built-in presets of every family, NULL-terminated static array: transformers ("tiny",
 * "tiny-qwen2", "demo", "bench-cpu"), then Mamba-1 SSMs ("tiny-ssm", "bench-ssm"; since 0.3). */
SG_API const char* const* sg_model_preset_names(void);

/* A randomly initialised model (any family) from a built-in preset. dtype: "f32" or "f64" (NULL = "f32"), or "bf16"
 * (CPU; Llama/Qwen2/Qwen3: weight matrices, KV pages and logits in bf16 over f32 compute; since 0.7 Mamba too, its
 * linear and embedding matrices and logits; sg_model_dtype is then f32 and
 * each parameter's sg_param dtype says how it is stored). */
SG_API sg_status* sg_model_create_preset(const char* preset, const char* dtype, uint64_t seed, sg_model** out);
/* A model from a Hugging Face directory (config.json + model.safetensors[.index.json]) whose config.json
 * model_type is "llama", "qwen2" or (since 0.3) "mamba" (MambaForCausalLM). dtype as above. */
SG_API sg_status* sg_model_load(const char* hf_dir, const char* dtype, sg_model** out);
/* Writes config.json + model.safetensors into dir (created if missing), for either family, loadable by
 * sg_model_load and by Hugging Face transformers. SG_ERR_BUSY while a step runs. A model with LoRA (since 0.5) is
 * written merged: each adapted weight as W + (alpha / rank) B A, without adapter tensors, i.e. a plain HF model
 * (sg_model_save_lora_adapter writes the adapters alone). config.json is labelled with the dtype saved. A model
 * from sg_model_load (since 0.7) keeps its directory's generation_config.json, tokenizer files, chat template and
 * the config.json fields the engine does not use (bos/eos/pad token ids, ...). All or nothing: dir is replaced in
 * one rename, so it holds exactly the new model, or is unchanged when the save fails; beside other entries the
 * model's files are replaced one by one, and an earlier sharded model there is refused (SG_ERR_FAILED_PRECONDITION). */
SG_API sg_status* sg_model_save(sg_model* model, const char* dir);
/* Since 0.7: sg_model_save with the weights in `dtype`: NULL or "" as the model stores them (what sg_model_save
 * writes: a "bf16" model's weight matrices in bf16, its norms and biases in f32, config.json labelled bfloat16),
 * "f32" every tensor in f32 (bf16 matrices widened exactly), "bf16" only for a model created with dtype "bf16".
 * Other values, and "bf16" for an f32/f64 model: SG_ERR_INVALID_ARGUMENT naming the argument. */
SG_API sg_status* sg_model_save_as(sg_model* model, const char* dir, const char* dtype);
/* Drops the caller's reference (see Lifetimes). NULL is ignored. */
SG_API void sg_model_free(sg_model* model);

/* Since 0.7: where a model lives and how it is stored, for sg_model_create_preset_with / sg_model_load_with. */
typedef struct sg_model_options {
  size_t struct_size; /* sizeof(sg_model_options) of the header the caller compiled with */
  const char* dtype;  /* "f32" (NULL = "f32"), "f64" or "bf16", as the dtype argument of sg_model_create_preset */
  const char* device; /* "cpu" (NULL = "cpu") or "cuda": the model's tensors live in GPU memory and its steps run
                         there. Without a usable GPU, or in a library built without CUDA, SG_ERR_FAILED_PRECONDITION
                         "device 'cuda' cannot run: <why>". GPU memory is not host-addressable: see sg_param_info */
  uint64_t seed;      /* presets: the initialisation seed; ignored by sg_model_load_with */
  int frozen_base;    /* Since 0.8. Non-zero: no parameter of the model gets a gradient, so none is allocated; for
                         LoRA (sg_model_enable_lora next: only the adapters train) or a model that only scores. A
                         trainer step on it without LoRA is SG_ERR_FAILED_PRECONDITION. 0 (the default): as before */
  int offload_experts; /* Since 0.8. Non-zero (with frozen_base, on a mixture of experts): the expert weights are made
                          in host memory, one layer's at most on the device while the model is created, for trainers
                          with sg_trainer_options.offload_experts; SG_ERR_INVALID_ARGUMENT without frozen_base or MoE
                          layers */
} sg_model_options;
/* dtype "f32", device "cpu", seed 0, struct_size set. */
SG_API sg_model_options sg_model_default_options(void);
/* sg_model_create_preset / sg_model_load with options (NULL = the defaults). */
SG_API sg_status* sg_model_create_preset_with(const char* preset, const sg_model_options* options, sg_model** out);
SG_API sg_status* sg_model_load_with(const char* hf_dir, const sg_model_options* options, sg_model** out);
/* Since 0.7. The model's device: "cpu" or "cuda" (static strings); "" for NULL. */
SG_API const char* sg_model_device(const sg_model* model);

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

/* A zero-copy view of one parameter and its gradient (row-major, contiguous); on a GPU model (on_device != 0) the
 * addresses are GPU memory, which host code must not dereference: copy through sg_model_read_param /
 * sg_model_write_param instead. */
typedef struct sg_param_info {
  size_t struct_size;
  const char* name; /* Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight" */
  int dtype;        /* sg_dtype */
  int ndim;
  int64_t shape[SG_MAX_DIMS];
  int64_t numel;
  void* data; /* the parameter's values; writable */
  void* grad; /* its gradient, NULL for frozen parameters; valid after a compute_gradients/step; in sg_model_dtype
                 (the gradient of a bf16 parameter is f32) */
  int32_t on_device; /* since 0.7: nonzero when data and grad are device (GPU) addresses, not host memory */
} sg_param_info;

/* A zeroed sg_param_info with struct_size set. */
SG_API sg_param_info sg_param_info_init(void);
/* Parameter `index` in [0, sg_model_num_params). out->struct_size must be set (sg_param_info_init). */
SG_API sg_status* sg_model_param_info(const sg_model* model, int64_t index, sg_param_info* out);

/* Since 0.7: copies of a parameter's values (which = SG_PARAM_VALUE) or gradient (SG_PARAM_GRAD) between the model,
 * on any device, and host memory; bytes must be exactly numel x the element size (sg_param_info). A copy to the host
 * waits for the device's work and reports its faults. SG_ERR_FAILED_PRECONDITION for the gradient of a frozen
 * parameter, SG_ERR_BUSY while a step runs. */
enum { SG_PARAM_VALUE = 0, SG_PARAM_GRAD = 1 };
SG_API sg_status* sg_model_read_param(const sg_model* model, int64_t index, int which, void* dst, size_t bytes);
SG_API sg_status* sg_model_write_param(sg_model* model, int64_t index, int which, const void* src, size_t bytes);

/* ---- LoRA (since 0.5) ------------------------------------------------------------------------------------------
 *
 * Low-rank adapters in Hugging Face PEFT's convention on the linear layers of either family: a module with weight
 * W [out, in] computes y = x W^T + (alpha / rank) dropout(x) A^T B^T, A [rank, in] drawn uniformly in +-1/sqrt(in),
 * B [out, rank] = 0 (training starts from the base model's function). The adapters are ordinary parameters
 * ("<module>.lora_A.weight", "<module>.lora_B.weight", listed by sg_model_param_info after the base parameters);
 * every base parameter is frozen (its gradient is released: sg_param_info.grad is NULL), so gradients and AdamW
 * moments exist for the adapters only. Every strategy and objective trains them. Dropout acts on the adapters' input
 * in gradient passes only (evaluation and reference log-prob passes use none); its mask is a function of the seed,
 * step, sequence, module, position and feature, so checkpoints resume it exactly. */

typedef struct sg_lora_options {
  size_t struct_size;  /* sizeof(sg_lora_options) of the header the caller compiled with */
  int64_t rank;        /* r >= 1 (default 8) */
  double alpha;        /* lora_alpha: the adapters' output is scaled by alpha / rank; > 0, or 0 = 2 * rank (the
                          default) */
  double dropout;      /* lora_dropout on the adapters' input, in [0, 1) (default 0) */
  const char* targets; /* comma-separated Hugging Face module names, or "all" (copied). Llama/Qwen2: q_proj, k_proj,
                          v_proj, o_proj, gate_proj, up_proj, down_proj; MoE layers' fused expert weights:
                          experts.gate_up_proj, experts.down_proj (PEFT's target_parameters; dropout 0 there);
                          Mamba: in_proj, x_proj (what PEFT applies). NULL = the family's default: "q_proj,v_proj" (transformers), "in_proj,x_proj" (SSMs) */
  uint64_t seed;       /* initialisation of A (default 0) */
} sg_lora_options;

SG_API sg_lora_options sg_lora_default_options(void);

/* Adds adapters to every module of the model named in options->targets and freezes every base parameter. Once per
 * model, before any trainer of it is created (its optimizer state would not match): SG_ERR_FAILED_PRECONDITION when
 * LoRA is already on or the model has a trainer. Errors: SG_ERR_INVALID_ARGUMENT naming the option (rank, alpha,
 * dropout, an unknown or repeated target, a target no module of this model has), SG_ERR_BUSY while a step uses the
 * model. */
SG_API sg_status* sg_model_enable_lora(sg_model* model, const sg_lora_options* options);
/* The model's LoRA options into *out (out->struct_size must be set: sg_lora_default_options()): rank 0 when LoRA is
 * off. out->targets is the module list joined by commas, valid until the model is destroyed. */
SG_API sg_status* sg_model_lora(const sg_model* model, sg_lora_options* out);
/* Writes the adapters as Hugging Face PEFT files into dir (created if missing): adapter_model.safetensors (tensors
 * "base_model.model.<module>.lora_A.weight" / ".lora_B.weight" in the model's dtype) and adapter_config.json
 * (peft_type LORA, r, lora_alpha, lora_dropout, target_modules), each atomically, loadable by
 * peft.PeftModel.from_pretrained(base, dir) and by sg_model_load_lora_adapter. base_model_name_or_path (may be NULL)
 * goes into the config as PEFT records it. SG_ERR_FAILED_PRECONDITION without LoRA. */
SG_API sg_status* sg_model_save_lora_adapter(sg_model* model, const char* dir, const char* base_model_name_or_path);
/* Loads a PEFT adapter directory into the model. LoRA off: enables it with the adapter's rank, alpha, dropout and
 * targets first (the rules of sg_model_enable_lora apply); LoRA on: rank, alpha and targets must equal the adapter's
 * (dropout may differ: it is a training setting). Every tensor of the file must be an adapter of this model with the
 * model's shape and every adapter of the model must be in the file: an adapter for a different base model is
 * SG_ERR_INVALID_ARGUMENT naming the tensor and both shapes; a corrupt or truncated file SG_ERR_INVALID_ARGUMENT
 * naming the file; a missing one SG_ERR_NOT_FOUND. On error the adapter weights are unchanged. */
SG_API sg_status* sg_model_load_lora_adapter(sg_model* model, const char* dir);

/* ---- Trainer ------------------------------------------------------------------------------------------------- */

typedef struct sg_trainer sg_trainer;

/* Since 0.7: the most threads sg_trainer_options.num_threads may ask for (more is refused: OpenMP would try to start
 * them all, far past any machine's cores). */
#define SG_MAX_THREADS 1024

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
  /* Since 0.5: the learning-rate schedule and gradient accumulation. The learning rate of optimizer step s (1-based),
   * W = warmup_steps, S = total_steps: s <= W: lr * s / W (linear warmup); then "constant": lr; "cosine":
   * min_lr + (lr - min_lr) (1 + cos(pi p)) / 2 and "linear": lr - (lr - min_lr) p, p = min(1, (s - W) / (S - W)),
   * i.e. min_lr from step S on. sg_metrics.lr reports the learning rate each step used. */
  const char* lr_schedule; /* "constant" | "cosine" | "linear" (copied; NULL = "constant") */
  int64_t warmup_steps;    /* >= 0 (default 0: no warmup) */
  double min_lr;           /* the floor the decaying schedules reach at total_steps; in [0, lr] (default 0) */
  int64_t total_steps;     /* the decay's horizon in optimizer steps; cosine and linear need > warmup_steps; ignored by
                              constant (default 0) */
  int64_t grad_accum;      /* micro-batches per optimizer step, >= 1 (default 1). The library does not split batches:
                              the caller feeds grad_accum micro-batches to sg_trainer_accumulate_gradients* and then
                              calls sg_trainer_optimizer_step (metrics.micro_batches says how many a step used). It is
                              part of the run configuration that checkpoints record, so a resume with another value is
                              refused */
  /* Since 0.6: SeCOv2 for strategy "seco" on transformers (both are refused elsewhere: SG_ERR_INVALID_ARGUMENT). */
  int64_t sparse_pages;    /* page-level sparse attention: each query chunk attends, per layer, to page 0, the pages it
                              overlaps and the one before, and the sparse_pages other earlier pages of highest score
                              (mean query . mean key); only those receive KV gradients. >= 0 (default 0: dense) */
  int32_t offload;         /* nonzero: every layer's KV and KV-gradient pages live in host memory and the device holds
                              a few layers (with sparse_pages, only the pages a chunk reads); gradients are the same
                              bits (default 0) */
  /* Since 0.7 (the field was reserved_0_6, which had to be zero: 0.6 callers get the default). */
  int32_t num_threads;     /* OpenMP/OpenBLAS threads of this trainer's calls, set on the calling thread around each
                              call and restored after it; 0 .. SG_MAX_THREADS (default 0: the caller's, i.e.
                              OMP_NUM_THREADS or one per core). Recorded in checkpoints: a resume with another count works but is no longer
                              bit-identical to an uninterrupted run (reductions split differently), which
                              sg_trainer_load_checkpoint/resume report as a warning on stderr */
  /* Since 0.7 (appended after num_threads; the size without it is still accepted: tp = 1): tensor parallelism. */
  int64_t tp;              /* 0 or 1 (default): one process. N > 1: the trainer joins the MPI job the program was
                              launched in (mpirun -np N; OpenMPI) and splits the model over its N ranks, Megatron
                              style (README "Tensor parallel"; transformers only): each rank holds 1/N of the heads,
                              KV cache, SwiGLU width and vocabulary. See "Tensor parallel" below */
  /* Since 0.7 (appended after tp; the size without it is still accepted: 0, the plain k3 those callers built with). */
  int32_t grpo_kl_bias_correction; /* grpo: nonzero: the KL term is r_t k3 (r_t the ratio above, not clipped), TRL's
                                      use_bias_correction_kl and its default, whose gradient is the unbiased
                                      reverse-KL gradient; 0: plain k3 (default 1) */
  /* Since 0.8 (appended after 0.7's tail padding; the 0.7 size is still accepted: 0). */
  int32_t unused_0_7;      /* 0.7's tail padding: ignored */
  int32_t offload_experts; /* nonzero: on a mixture of experts whose expert weights are frozen (LoRA), every MoE
                              layer's expert weights live in host memory and stream through the device two layers'
                              worth at a time; the same bits (default 0). Refused without MoE layers or frozen
                              experts (SG_ERR_INVALID_ARGUMENT) */
} sg_trainer_options;

SG_API sg_trainer_options sg_trainer_default_options(void);

/* ---- Tensor parallel (since 0.7) ------------------------------------------------------------------------------
 *
 * A program launched under mpirun -np N (OpenMPI, one process per rank) trains with N-way tensor
 * parallelism by setting options.tp = N on every rank. Every rank runs the same program: it creates or loads the
 * same whole model (same preset and seed, or directory; LoRA enabled the same way), creates its trainer with the
 * same options, and makes the same calls with the same arguments (the same batches) in the same order.
 *  - MPI comes from libseqgrad_mpi.so, which the library loads only then (libseqgrad.so itself needs no MPI): beside
 *    libseqgrad.so, or where the environment variable SEQGRAD_MPI_PLUGIN names it; it links the system's OpenMPI
 *    (libmpi.so.40), the one mpirun belongs to. Without it: SG_ERR_FAILED_PRECONDITION naming both.
 *  - sg_trainer_create is collective: it joins the job and keeps this rank's blocks of the model (a copy the trainer
 *    trains). Refused on every rank, with the numbers, never a hang: tp not dividing the heads, KV heads,
 *    intermediate_size or vocabulary ("options->tp = 2: vocab_size=97 is not divisible by 2 (1 left over)";
 *    presets "tiny" and "tiny-qwen2" have prime vocabularies, "demo" splits over 2), tp above the KV heads, a job
 *    whose size is not a multiple of tp ("the job has 2 ranks, which is not tp (3) x ..."), ranks given different
 *    tp (each rank's listed), ranks with different models or options (Mamba: d_inner, i.e. intermediate_size, and
 *    the vocabulary must divide), a second tp trainer of the same model.
 *  - A model on "cuda" keeps this rank's blocks in device memory (the process's current GPU: ranks may share one);
 *    the group's all-reduces, the gathers into the handle, saves and checkpoints go through host copies.
 *  - A job of k x tp ranks is a grid of k tensor-parallel groups (world rank w is tensor rank w % tp of group
 *    w / tp), as train --tp makes: every rank still passes the whole batch, each group computes the gradients of
 *    its k-th share of the records (sg_trainer_compute_gradients* and sg_trainer_step*) and the groups' gradients
 *    are summed, so the result is one process's on the whole batch. sg_trainer_accumulate_gradients* is refused
 *    (SG_ERR_UNIMPLEMENTED) when k > 1.
 *  - The handle keeps showing the whole model: after each call that computes gradients or steps, this rank's
 *    blocks of the gradients and weights are gathered into the handle's model, so sg_model_param_info views,
 *    sg_model_read_param and the gradients show exactly what one process would hold; values written through them
 *    (sg_model_write_param, a view's data) are taken by the next call. (The cost: the handle holds a whole copy
 *    beside the trainer's blocks, and each call gathers the model over the group.)
 *  - sg_model_save / sg_model_save_as of the model, sg_trainer_save_checkpoint, sg_trainer_load_checkpoint and
 *    sg_trainer_resume become collective (every rank calls them): saves and checkpoints hold the whole model (and
 *    the whole AdamW moments), written by rank 0 alone, exactly what one process writes; every rank returns rank
 *    0's status. A checkpoint resumes across tp and one process both ways.
 *  - sg_metrics' memory fields are this rank's; sg_metrics.tp and tp_bytes_reduced report the split.
 *  - A trainer call that fails on one rank before its collective part (a bad argument, SG_ERR_BUSY, a cancel) fails
 *    on every rank at once: that rank returns its error, the others SG_ERR_ABORTED "rank r of N failed", and the next
 *    call trains on. Ranks are not checked to pass the same batch: different batches give a wrong step. A rank that
 *    stops calling (or dies) leaves the others in a collective until the MPI timeout (SEQGRAD_DIST_TIMEOUT_S, default
 *    300 s) ends it with SG_ERR_DEADLINE_EXCEEDED. */

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
  /* Since 0.5. */
  double lr;             /* the (scheduled) learning rate of this call's optimizer step; 0 when no optimizer step ran */
  int64_t micro_batches; /* batches whose gradients this call's optimizer step used: 1 after compute_gradients, the
                            number of sg_trainer_accumulate_gradients* calls since the last step after accumulation;
                            0 when no optimizer step ran */
  /* Since 0.7: category SG_MEMORY_CATEGORY_MASTER_WEIGHTS, as in the arrays above. */
  int64_t peak_bytes_master_weights;
  int64_t bytes_at_peak_master_weights;
  /* Since 0.7 (appended; the size without them is still accepted). With options.tp = N > 1 every memory field above
   * is this rank's (its blocks of the weights, gradients and moments, its KV heads), about 1/N of one process's. */
  int64_t tp;                 /* ranks the model is split over (1 without tensor parallelism) */
  int64_t tp_bytes_reduced;   /* bytes this rank sent to its group in the call's forward, backward and optimizer step
                                 (the all-reduces of tensor parallelism); 0 with tp = 1 */
} sg_metrics;

/* A zeroed sg_metrics with struct_size set. */
SG_API sg_metrics sg_metrics_init(void);

/* Gradients of the mean token loss of a batch (gradients are zeroed first).
 *   ids:        num_tokens token ids, the sequences concatenated
 *   labels:     num_tokens labels aligned with ids in Hugging Face's convention (see Labels: labels[t] is the token
 *               at t, -100 = ignored, shifted within each sequence by the library), or NULL for next-token labels
 *               (labels = ids)
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
 * (prompt + response), labels[i] to lengths[i] labels aligned with them in Hugging Face's convention (see Labels:
 * labels[i][t] is the token at t, -100 = ignored: label the response tokens only). A NULL labels array, or a NULL
 * labels[i], means next-token labels over the whole sequence (labels = ids). Every sequence needs a label at some
 * position >= 1. The library copies what it reads; the
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
/* Since 0.7: the reference of dpo/grpo is the trainer's own model with its LoRA adapters switched off (as StreamBP
 * does): the frozen base weights the adapters sit on, with no second model and no second copy of the weights. The
 * results equal those with a separately loaded copy of the base model as sg_trainer_set_reference. Replaces a
 * reference model; sg_trainer_set_reference (NULL or another model) replaces this. Errors:
 * SG_ERR_INVALID_ARGUMENT (NULL trainer), SG_ERR_FAILED_PRECONDITION (the model has no LoRA), SG_ERR_BUSY. */
SG_API sg_status* sg_trainer_set_reference_base_model(sg_trainer* trainer);

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
 *                                                  + grpo_kl_beta w_t k3(ref_t - logp_t)) / (|o_i| G B),
 * r_t = exp(logp_t - old_t), w_t = r_t with options.grpo_kl_bias_correction (the default) or 1, |o_i| the labelled
 * tokens of completion i, G its group's size, B = num_groups.
 * Gradients are zeroed first. Completions form one list of num_completions >= 1; group g holds completions
 * [group_offsets[g], group_offsets[g + 1]):
 *   ids, labels, lengths: completion c's sequence, prompt + completion (see above; labels may be NULL)
 *   advantages:     num_completions finite advantages A_c
 *   old_logprobs:   NULL, or num_completions pointers, each NULL or lengths[c] log-probs of the labels under the
 *                   policy that sampled the completion, aligned with labels (since 0.7, Hugging Face-aligned:
 *                   old_logprobs[c][t] = log p_old(labels[c][t] | ids[c][0..t)), what sg_trainer_score returns);
 *                   finite where labels[c][t] is a label (t >= 1), anything (e.g. NaN) at t = 0 and where it is
 *                   -100.
 *                   NULL: old = the current policy (r_t = 1)
 *   ref_logprobs:   the same for the reference policy (sg_trainer_score of a trainer over the reference model
 *                   gives them); NULL: computed by the reference model
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

/* ---- Gradient accumulation (since 0.5) -------------------------------------------------------------------------
 *
 * One optimizer step over micro-batches fed one at a time: each accumulate call adds its micro-batch's gradient
 * (zeroing the gradients first when no accumulation is pending), and sg_trainer_optimizer_step divides the sum by
 * the total count (valid tokens for sft, pairs for dpo, groups for grpo) before clipping and AdamW, so that the step
 * equals one on a batch holding every micro-batch's sequences (spaco draws its chunks per call, so only its sampling
 * differs). The optimizer step's metrics report the loss over all micro-batches and micro_batches. Each accumulate
 * call's metrics report its own micro-batch's mean loss. compute_gradients*, step* and a failed accumulate call drop
 * a pending accumulation; checkpoints do not hold one (save after an optimizer step). Arguments and errors are those
 * of the matching compute_gradients call. */
SG_API sg_status* sg_trainer_accumulate_gradients(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                                  int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                                  sg_metrics* out);
SG_API sg_status* sg_trainer_accumulate_gradients_dpo(sg_trainer* trainer, const int32_t* const* chosen_ids,
                                                      const int32_t* const* chosen_labels,
                                                      const int64_t* chosen_lengths,
                                                      const int32_t* const* rejected_ids,
                                                      const int32_t* const* rejected_labels,
                                                      const int64_t* rejected_lengths, const double* ref_chosen_logp,
                                                      const double* ref_rejected_logp, int64_t num_pairs,
                                                      sg_metrics* out);
SG_API sg_status* sg_trainer_accumulate_gradients_grpo(sg_trainer* trainer, const int32_t* const* ids,
                                                       const int32_t* const* labels, const int64_t* lengths,
                                                       const double* advantages, const double* const* old_logprobs,
                                                       const double* const* ref_logprobs, int64_t num_completions,
                                                       const int64_t* group_offsets, int64_t num_groups,
                                                       sg_metrics* out);

/* ---- Checkpoints (since 0.5) -----------------------------------------------------------------------------------
 *
 * A checkpoint is a directory <out_dir>/checkpoint-<step> holding the model's parameters (LoRA adapters included,
 * bit exact; with config.json it is a Hugging Face model directory), the AdamW moments, the step, spaco's and LoRA
 * dropout's sampling counter, the caller's data position and the run configuration (the model's config and LoRA
 * options, the strategy, optimizer (schedule, grad_accum) and objective options), each file with its size and
 * CRC-32. It is written into a temporary directory, fsynced and renamed into place: a crash at any moment leaves the
 * previous checkpoints intact. Loading one into a trainer built like the one that saved it (same model
 * configuration and LoRA, same options) continues the run exactly: the next steps give bit-identical losses on CPU.
 * Errors of loading, all before anything is restored:
 *   SG_ERR_DATA_LOSS            a truncated, corrupt (CRC-32 mismatch) or incomplete checkpoint, naming the file;
 *   SG_ERR_FAILED_PRECONDITION  a checkpoint written with another run configuration (the message lists every
 *                               differing field, "strategy.chunk: checkpoint '512', now '256'"), or a tensor whose
 *                               shape or dtype differs from the model's;
 *   SG_ERR_NOT_FOUND            no checkpoint there;
 *   SG_ERR_BUSY                 a step of the trainer's model runs. */

/* Writes <out_dir>/checkpoint-<sg_trainer_step_count(trainer)> (out_dir is created if missing; an existing
 * checkpoint of that step is replaced), then keeps it and the keep - 1 newest others (keep = 0: keep all).
 * data_position (>= 0): where the caller is in its training data (e.g. records consumed), returned by load/resume.
 * Errors: SG_ERR_INVALID_ARGUMENT (NULL, data_position < 0, keep < 0), the code of the errno when out_dir or a file
 * cannot be created or written (see Conventions), SG_ERR_BUSY. */
SG_API sg_status* sg_trainer_save_checkpoint(sg_trainer* trainer, const char* out_dir, int64_t data_position,
                                             int64_t keep);
/* Restores a checkpoint directory (a checkpoint-<step> written by sg_trainer_save_checkpoint) into the trainer: its
 * model's parameters, the optimizer moments and step, and the sampling counter. step and data_position (each may be
 * NULL) receive the checkpoint's. */
SG_API sg_status* sg_trainer_load_checkpoint(sg_trainer* trainer, const char* checkpoint_dir, int64_t* step,
                                             int64_t* data_position);
/* sg_trainer_load_checkpoint of the newest complete checkpoint in out_dir; newer ones that are damaged are skipped.
 * SG_ERR_NOT_FOUND when out_dir holds none (its message names the damaged ones skipped): start from step 0. */
SG_API sg_status* sg_trainer_resume(sg_trainer* trainer, const char* out_dir, int64_t* step, int64_t* data_position);

/* ---- Evaluation (since 0.5) ------------------------------------------------------------------------------------ */

/* Distances d between a query and its key are bucketed by powers of two: bucket k holds [2^k, 2^(k+1)). */
#define SG_MAX_DISTANCE_BUCKETS 64

typedef struct sg_eval_result {
  size_t struct_size;  /* set by the caller (sg_eval_result_init) */
  int64_t sequences;
  int64_t tokens;      /* labelled positions */
  double loss;         /* mean token loss (cross-entropy) over them */
  double perplexity;   /* exp(loss) */
  int64_t correct;     /* labelled positions whose arg max of the logits equals the label */
  double accuracy;     /* correct / tokens */
  int64_t peak_bytes;  /* peak of total engine memory during the call */
  double seconds;      /* wall time of the call */
  /* With distances: buckets 0 .. num_buckets - 1 (the largest seen; empty ones have count 0); 0 without. */
  int64_t num_buckets;
  int64_t bucket_count[SG_MAX_DISTANCE_BUCKETS];   /* labelled positions whose distance falls in bucket k */
  int64_t bucket_correct[SG_MAX_DISTANCE_BUCKETS]; /* of which the arg max equals the label */
  double bucket_loss[SG_MAX_DISTANCE_BUCKETS];     /* their mean token loss (0 for an empty bucket) */
} sg_eval_result;

/* A zeroed sg_eval_result with struct_size set. */
SG_API sg_eval_result sg_eval_result_init(void);

/* Held-out evaluation of a batch without gradients (one chunked forward pass per sequence: options.chunk tokens at a
 * time, options.lm_chunk rows of logits; no dropout): loss, perplexity, next-token accuracy and, for a retrieval
 * task, accuracy as a function of the distance between a query and its key. The batch as in
 * sg_trainer_compute_gradients; distances: NULL, or num_tokens entries aligned with the labels (see Labels): for
 * every label labels[t] (t >= 1, not -100) the distance (>= 1, in tokens) from the key it is retrieved from; ignored
 * elsewhere.
 * Gradients, the optimizer and the progress callback are left alone; any objective. out->struct_size must be set.
 * Errors as sg_trainer_evaluate, and SG_ERR_INVALID_ARGUMENT for a distance < 1 at a labelled position. */
SG_API sg_status* sg_trainer_evaluate_detailed(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                               int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                               const int64_t* distances, sg_eval_result* out);

/* ---- Per-token log-probs (since 0.7) --------------------------------------------------------------------------- */

/* Log-probabilities of the labelled tokens of a batch under the trainer's model, without gradients: for sequence s
 * and position t, logprobs[offset_s + t] = log p(labels[t] | ids[0..t)) (labels NULL: ids[t]), the natural log of
 * the model's softmax, for every t >= 1 whose label is not -100; NaN at position 0 of each sequence and where the
 * label is -100. The output is thus aligned with ids and labels (see Labels): it is what grpo's old_logprobs /
 * ref_logprobs take (score a trainer over the policy that sampled, or over the reference model), and the sum over a
 * sequence's entries is the log-likelihood that dpo's ref_*_logp take. Computed by the engine's chunked forward pass
 * (options.chunk tokens at a time, options.lm_chunk rows of logits, never a sequence x vocabulary array) at any
 * length, for every model family, in the model's dtype; no dropout. Any objective; gradients, the optimizer and the
 * progress callback are left alone. The batch as in sg_trainer_compute_gradients, except that a batch without any
 * label is allowed (all NaN).
 *   logprobs: num_tokens doubles, written by the call
 *   out:      NULL or metrics with struct_size set: loss (mean of -logprob over the labelled tokens; NaN without
 *             any), tokens, step, memory and seconds
 * Errors: SG_ERR_INVALID_ARGUMENT (names the argument), SG_ERR_BUSY, SG_ERR_CANCELLED, SG_ERR_RESOURCE_EXHAUSTED.
 * A trainer over a model that only scores (e.g. a reference model) allocates nothing until its first optimizer
 * step. */
SG_API sg_status* sg_trainer_score(sg_trainer* trainer, const int32_t* ids, const int32_t* labels,
                                   int64_t num_tokens, const int64_t* lengths, int64_t num_sequences,
                                   double* logprobs, sg_metrics* out);

/* ---- Batches of packed documents (since 0.8) -------------------------------------------------------------------
 *
 * A batch as one struct, which may carry each sequence's documents: several documents packed into one sequence train
 * exactly as each alone (a position attends only within its document, RoPE positions restart at each document, no
 * label crosses into the next document: the label of a document's first token is ignored). The *_batch calls are
 * the calls above (same results, errors and metrics) with the batch's arguments in an sg_batch; without documents
 * they equal them. Every model family, strategy and device takes documents. */
typedef struct sg_batch {
  size_t struct_size;     /* sizeof(sg_batch) of the header the caller compiled with (sg_batch_init) */
  const int32_t* ids;     /* num_tokens token ids, the sequences concatenated (as in sg_trainer_compute_gradients) */
  const int32_t* labels;  /* NULL or num_tokens labels aligned with ids (see Labels) */
  int64_t num_tokens;
  const int64_t* lengths; /* num_sequences lengths (each >= 1) summing to num_tokens */
  int64_t num_sequences;
  /* NULL (every sequence one document), or num_sequences counts: sequence s packs num_documents[s] documents (0 or 1:
   * one document) */
  const int64_t* num_documents;
  /* The documents' lengths in tokens (each >= 1), sequence after sequence: num_documents[s] of them summing to
   * lengths[s]. May be NULL when every count is 0. */
  const int64_t* doc_lengths;
} sg_batch;

/* A zeroed sg_batch with struct_size set. */
SG_API sg_batch sg_batch_init(void);

/* Errors of every *_batch call, besides those of the matching call: SG_ERR_INVALID_ARGUMENT for a NULL batch, a
 * struct_size smaller than 0.8's, a negative count or one above lengths[s] ("num_documents[2] = 9"), a length below 1
 * ("doc_lengths[2][1] = 0": sequence 2's document 1) or lengths that do not sum to lengths[s]. */
SG_API sg_status* sg_trainer_compute_gradients_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out);
SG_API sg_status* sg_trainer_step_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out);
SG_API sg_status* sg_trainer_accumulate_gradients_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out);
SG_API sg_status* sg_trainer_evaluate_batch(sg_trainer* trainer, const sg_batch* batch, sg_metrics* out);
SG_API sg_status* sg_trainer_evaluate_detailed_batch(sg_trainer* trainer, const sg_batch* batch,
                                                     const int64_t* distances, sg_eval_result* out);
SG_API sg_status* sg_trainer_score_batch(sg_trainer* trainer, const sg_batch* batch, double* logprobs,
                                         sg_metrics* out);

#ifdef __cplusplus
}
#endif

#endif /* SEQGRAD_SEQGRAD_H_ */
