/* C99 tests of the seqgrad C API: the full lifecycle and every error path, through the public header only. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "seqgrad/seqgrad.h"

static int g_failures = 0;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

/* Checks that `st` has `code` and that its message contains `needle`; frees it. Messages speak of arguments and
 * struct fields (options->chunk), never of the command-line tools' flags (--chunk). */
static void expect_status(sg_status* st, int code, const char* needle, int line) {
  const char* flag = strstr(sg_status_message(st), "--");
  if (sg_status_code(st) != code || (needle && !strstr(sg_status_message(st), needle))) {
    fprintf(stderr, "line %d: expected %s containing '%s', got %s: %s\n", line, sg_code_name(code),
            needle ? needle : "", sg_code_name(sg_status_code(st)), sg_status_message(st));
    ++g_failures;
  }
  if (flag && flag[2] >= 'a' && flag[2] <= 'z') {
    fprintf(stderr, "line %d: the message names a flag, not a field: %s\n", line, sg_status_message(st));
    ++g_failures;
  }
  sg_status_free(st);
}
#define EXPECT_STATUS(st, code, needle) expect_status((st), (code), (needle), __LINE__)
#define EXPECT_OK(st) expect_status((st), SG_OK, NULL, __LINE__)

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&ts, NULL);
}

#define SEQ 24
static int32_t g_ids[2 * SEQ];
static int64_t g_lengths[2] = {SEQ, SEQ};

static void make_batch(void) {
  int i;
  for (i = 0; i < 2 * SEQ; ++i) g_ids[i] = (int32_t)((i * 7 + 3) % 50);
}

static sg_model* tiny_model(void) {
  sg_model* m = NULL;
  EXPECT_OK(sg_model_create_preset("tiny", "f32", 1, &m));
  return m;
}

static sg_trainer* new_trainer(sg_model* m, const char* strategy) {
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = strategy;
  o.chunk = 8;
  o.page_size = 8;
  o.lr = 3e-3;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  return t;
}

static void test_version(void) {
  char want[64];
  sprintf(want, "%d.%d.%d", SG_VERSION_MAJOR, SG_VERSION_MINOR, SG_VERSION_PATCH);
  CHECK(strcmp(sg_version(), want) == 0);
  CHECK(strcmp(sg_code_name(SG_ERR_BUSY), "BUSY") == 0);
  CHECK(strcmp(sg_memory_category_name(0), "weights") == 0);
  CHECK(strcmp(sg_memory_category_name(SG_NUM_MEMORY_CATEGORIES - 1), "workspace") == 0);
  CHECK(strcmp(sg_memory_category_name(SG_MEMORY_CATEGORY_MASTER_WEIGHTS), "master_weights") == 0);
  CHECK(sg_memory_category_name(SG_NUM_MEMORY_CATEGORIES_ALL) == NULL);
  CHECK(sg_memory_category_name(-1) == NULL);
  CHECK(strcmp(sg_dtype_name(SG_DTYPE_F64), "f64") == 0);
  CHECK(strcmp(sg_model_preset_names()[0], "tiny") == 0);
  CHECK(sg_status_code(NULL) == SG_OK);
  CHECK(strcmp(sg_status_message(NULL), "") == 0);
  sg_status_free(NULL);
  sg_model_free(NULL);
  sg_trainer_free(NULL);
  sg_trainer_cancel(NULL);
}

static int g_progress_calls = 0;
static double g_progress_loss = 0;
static void on_progress(void* user, const sg_progress* p) {
  CHECK(user == (void*)&g_progress_calls);
  CHECK(p->struct_size >= sizeof(sg_progress));
  CHECK(p->tokens > 0);
  ++g_progress_calls;
  g_progress_loss = p->loss;
}

static void test_lifecycle(void) {
  const char* tmp = getenv("TEST_TMPDIR");
  char dir[1024];
  sg_model* m = tiny_model();
  sg_model* loaded = NULL;
  sg_trainer* t;
  sg_metrics met = sg_metrics_init();
  double first = 0, last = 0;
  int step, i, c;
  int64_t n;
  int64_t sum_at_peak = 0;
  sg_param_info p = sg_param_info_init(), q = sg_param_info_init();

  CHECK(sg_model_vocab_size(m) == 97);
  CHECK(sg_model_num_layers(m) == 3);
  CHECK(sg_model_dtype(m) == SG_DTYPE_F32);
  CHECK(strcmp(sg_model_family(m), "transformer") == 0);
  t = new_trainer(m, "seco");
  EXPECT_OK(sg_trainer_set_progress_callback(t, on_progress, &g_progress_calls));
  for (step = 0; step < 4; ++step) {
    EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    CHECK(isfinite(met.loss));
    if (step == 0) first = met.loss;
    last = met.loss;
  }
  CHECK(last < first);
  CHECK(met.step == 4);
  CHECK(sg_trainer_step_count(t) == 4);
  CHECK(met.tokens == 2 * (SEQ - 1));
  CHECK(met.grad_norm > 0);
  CHECK(met.peak_bytes > 0);
  CHECK(met.peak_bytes_by_category[0] > 0); /* weights */
  CHECK(met.peak_bytes_by_category[2] > 0); /* optimizer */
  for (c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c) sum_at_peak += met.bytes_at_peak_by_category[c];
  CHECK(sum_at_peak == met.peak_bytes);
  CHECK(met.chunks == 6 && met.chunks_backpropagated == 6); /* seco: 3 chunks of 8 per sequence, all of them */
  CHECK(g_progress_calls == 8); /* phase 0 and 1 of each step */
  CHECK(g_progress_loss == last);

  /* compute_gradients with explicit labels, then an optimizer step. */
  {
    int32_t labels[2 * SEQ];
    for (i = 0; i < 2 * SEQ; ++i) labels[i] = (i % 3 == 1) ? g_ids[(i + 1) % (2 * SEQ)] : -100;
    EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, labels, 2 * SEQ, g_lengths, 2, &met));
    CHECK(met.tokens == 16);
    CHECK(met.step == 4);
    EXPECT_OK(sg_trainer_optimizer_step(t, &met));
    CHECK(met.step == 5);
    EXPECT_OK(sg_trainer_optimizer_step(t, NULL));
  }

  /* Zero-copy views. */
  n = sg_model_num_params(m);
  CHECK(n > 3);
  EXPECT_OK(sg_model_param_info(m, 0, &p));
  CHECK(strcmp(p.name, "model.embed_tokens.weight") == 0);
  CHECK(p.ndim == 2 && p.shape[0] == 97 && p.shape[1] == 32 && p.numel == 97 * 32);
  CHECK(p.dtype == SG_DTYPE_F32 && p.data != NULL && p.grad != NULL);

  /* save -> load -> same values. */
  sprintf(dir, "%s/tiny_saved", tmp ? tmp : "/tmp");
  EXPECT_OK(sg_model_save(m, dir));
  EXPECT_OK(sg_model_load(dir, "f32", &loaded));
  CHECK(sg_model_num_params(loaded) == n);
  for (i = 0; i < n; ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    EXPECT_OK(sg_model_param_info(loaded, i, &q));
    CHECK(strcmp(p.name, q.name) == 0);
    CHECK(p.numel == q.numel);
    CHECK(memcmp(p.data, q.data, (size_t)p.numel * sizeof(float)) == 0);
  }
  /* The trainer keeps the model alive after sg_model_free. */
  sg_model_free(m);
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  sg_trainer_free(t);
  sg_model_free(loaded);
}

static void test_errors(void) {
  sg_model* m = tiny_model();
  sg_model* none = NULL;
  sg_trainer* t = new_trainer(m, "full");
  sg_trainer* tout = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics met = sg_metrics_init();
  sg_param_info p = sg_param_info_init();
  int32_t bad_ids[4] = {1, 2, 97, 3};
  int32_t neg_ids[4] = {1, -1, 2, 3};
  int32_t bad_labels[4] = {1, 2, -5, 3};
  int32_t ignored[4] = {-100, -100, -100, -100};
  int64_t len4[1] = {4};
  int64_t len_bad[2] = {3, 3};
  int64_t len_zero[2] = {4, 0};
  int64_t len_neg[2] = {610, -10};

  /* NULL handles and pointers. */
  EXPECT_STATUS(sg_model_create_preset(NULL, "f32", 0, &none), SG_ERR_INVALID_ARGUMENT, "'preset'");
  EXPECT_STATUS(sg_model_create_preset("tiny", "f32", 0, NULL), SG_ERR_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(sg_model_load(NULL, "f32", &none), SG_ERR_INVALID_ARGUMENT, "'hf_dir'");
  EXPECT_STATUS(sg_model_save(NULL, "/tmp/x"), SG_ERR_INVALID_ARGUMENT, "'model'");
  EXPECT_STATUS(sg_model_save(m, NULL), SG_ERR_INVALID_ARGUMENT, "'dir'");
  EXPECT_STATUS(sg_model_param_info(NULL, 0, &p), SG_ERR_INVALID_ARGUMENT, "'model'");
  EXPECT_STATUS(sg_model_param_info(m, 0, NULL), SG_ERR_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(sg_trainer_create(NULL, &o, &tout), SG_ERR_INVALID_ARGUMENT, "'model'");
  EXPECT_STATUS(sg_trainer_create(m, NULL, &tout), SG_ERR_INVALID_ARGUMENT, "'options'");
  EXPECT_STATUS(sg_trainer_create(m, &o, NULL), SG_ERR_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(sg_trainer_step(NULL, g_ids, NULL, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_step(t, NULL, NULL, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'ids'");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, NULL, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'lengths'");
  EXPECT_STATUS(sg_trainer_compute_gradients(NULL, g_ids, NULL, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT,
                "'trainer'");
  EXPECT_STATUS(sg_trainer_optimizer_step(NULL, NULL), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_set_progress_callback(NULL, NULL, NULL), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  CHECK(sg_model_vocab_size(NULL) == -1);
  CHECK(sg_model_num_params(NULL) == -1);
  CHECK(sg_trainer_step_count(NULL) == -1);

  /* Unknown names. */
  EXPECT_STATUS(sg_model_create_preset("tiny", "f8", 0, &none), SG_ERR_INVALID_ARGUMENT, "'dtype' is 'f8'");
  EXPECT_STATUS(sg_model_create_preset("huge", "f32", 0, &none), SG_ERR_INVALID_ARGUMENT, "known presets");
  CHECK(none == NULL);
  EXPECT_STATUS(sg_model_load("/nonexistent/dir", "f32", &none), SG_ERR_NOT_FOUND, "not a directory");
  o.strategy = "magic";
  EXPECT_STATUS(sg_trainer_create(m, &o, &tout), SG_ERR_INVALID_ARGUMENT, "magic");
  CHECK(tout == NULL);

  /* Struct sizes: this header's, an older header's (test_old_struct_sizes) or larger are accepted; others not. */
  o = sg_trainer_default_options();
  o.struct_size = sizeof(o) - 4; /* sizeof - 8 is the 0.6 size (before tp) */
  EXPECT_STATUS(sg_trainer_create(m, &o, &tout), SG_ERR_INVALID_ARGUMENT, "struct_size");
  o.struct_size = 0;
  EXPECT_STATUS(sg_trainer_create(m, &o, &tout), SG_ERR_INVALID_ARGUMENT, "struct_size");
  {
    struct {
      sg_trainer_options base;
      int64_t future_field;
    } bigger;
    bigger.base = sg_trainer_default_options();
    bigger.base.struct_size = sizeof(bigger);
    bigger.future_field = 42;
    EXPECT_OK(sg_trainer_create(m, &bigger.base, &tout));
    sg_trainer_free(tout);
    tout = NULL;
  }
  o = sg_trainer_default_options();
  o.lr = -1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &tout), SG_ERR_INVALID_ARGUMENT, "lr");
  /* Messages name the struct field (the core's option checks are shared with the tools, which name flags). */
  o = sg_trainer_default_options();
  o.chunk = 0;
  EXPECT_STATUS(sg_trainer_create(m, &o, &tout), SG_ERR_INVALID_ARGUMENT, "options->chunk must be positive, got 0");
  o.chunk = 8;
  o.strategy = "adjoint";
  EXPECT_STATUS(sg_trainer_create(m, &o, &tout), SG_ERR_INVALID_ARGUMENT,
                "options->strategy = adjoint needs a state-space model (Mamba or Mamba-2 layers");
  met.struct_size = 4;
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len4, 1, &met), SG_ERR_INVALID_ARGUMENT, "struct_size");
  met.struct_size = sizeof(met) - 4; /* between the published sizes */
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len4, 1, &met), SG_ERR_INVALID_ARGUMENT, "struct_size");
  p.struct_size = 0;
  EXPECT_STATUS(sg_model_param_info(m, 0, &p), SG_ERR_INVALID_ARGUMENT, "struct_size");
  p = sg_param_info_init();
  EXPECT_STATUS(sg_model_param_info(m, -1, &p), SG_ERR_OUT_OF_RANGE, "'index'");
  EXPECT_STATUS(sg_model_param_info(m, sg_model_num_params(m), &p), SG_ERR_OUT_OF_RANGE, "'index'");

  /* Bad batches. */
  EXPECT_STATUS(sg_trainer_step(t, bad_ids, NULL, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "ids[2] = 97");
  EXPECT_STATUS(sg_trainer_step(t, neg_ids, NULL, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "ids[1] = -1");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, bad_labels, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "labels[2] = -5");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, ignored, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "has no label");
  ignored[0] = 5; /* position 0's label is never predicted (Hugging Face's shift) */
  EXPECT_STATUS(sg_trainer_step(t, g_ids, ignored, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "has no label");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len_bad, 2, NULL), SG_ERR_INVALID_ARGUMENT, "'lengths'");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len_zero, 2, NULL), SG_ERR_INVALID_ARGUMENT, "lengths[1]");
  /* A negative length is named, not hidden in the sum (610 - 10 = 600 tokens). */
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 600, len_neg, 2, NULL), SG_ERR_INVALID_ARGUMENT,
                "lengths[1] is -10; every sequence needs >= 1 token");
  len_neg[0] = 300;
  len_neg[1] = INT64_MAX; /* the sum would overflow */
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 600, len_neg, 2, NULL), SG_ERR_INVALID_ARGUMENT,
                "'lengths' sums to more than 'num_tokens' (600) at lengths[1] = 9223372036854775807");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len4, 0, NULL), SG_ERR_INVALID_ARGUMENT, "'num_sequences'");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 0, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'num_tokens'");
  /* Still usable after all that. */
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 4, len4, 1, NULL));
  sg_trainer_free(t);
  sg_model_free(m);
}

/* Programs built against the 0.1 header (options and metrics end before the 0.2 fields), the 0.2 one (options end
 * before the 0.3 fields) or the 0.3 one (options and metrics end before the 0.4 fields) keep working. */
static void test_old_struct_sizes(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics met = sg_metrics_init();
  o.struct_size = offsetof(sg_trainer_options, spaco_budget);
  o.chunk = 8;
  o.page_size = 8;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  met.struct_size = offsetof(sg_metrics, chunks);
  met.chunks = met.chunks_backpropagated = -7; /* beyond the caller's struct: must stay untouched */
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  CHECK(met.tokens == 2 * (SEQ - 1) && met.step == 1 && met.seconds > 0);
  CHECK(met.chunks == -7 && met.chunks_backpropagated == -7);
  sg_trainer_free(t);
  /* The 0.2 fields beyond an old struct_size are not read: spaco runs with the default budget of 8 chunks, which
   * the 3-chunk sequences cannot meet, not with the 2 written there. */
  o.strategy = "spaco";
  o.spaco_budget = 2;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_INVALID_ARGUMENT,
                "options->spaco_budget = 8 exceeds the 3 chunks");
  sg_trainer_free(t);
  /* 0.2 size: the spaco fields are read, the 0.3 objective fields are not (the trainer stays sft). */
  o = sg_trainer_default_options();
  o.struct_size = offsetof(sg_trainer_options, objective);
  o.chunk = 8;
  o.page_size = 8;
  o.objective = "dpo";
  o.dpo_beta = -1;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  sg_trainer_free(t);
  t = NULL;
  o.struct_size = offsetof(sg_trainer_options, objective) + 8; /* neither a published size nor this library's */
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "0.2 size 240");
  CHECK(t == NULL);
  /* 0.3 size: the objective fields are read, the 0.4 adjoint fields are not (a window of 0 beyond the caller's struct
   * would be rejected); metrics of the 0.3 size leave adjoint_pairs alone. */
  o = sg_trainer_default_options();
  o.struct_size = offsetof(sg_trainer_options, adjoint_form);
  o.chunk = 8;
  o.page_size = 8;
  o.objective = "ppo";
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->objective is 'ppo'");
  o.objective = "sft";
  o.adjoint_form = "reverse";
  o.adjoint_window = 0;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  met = sg_metrics_init();
  met.struct_size = offsetof(sg_metrics, adjoint_pairs);
  met.adjoint_pairs = -7;
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  CHECK(met.chunks == 2 && met.adjoint_pairs == -7); /* full: one chunk per sequence */
  sg_trainer_free(t);
  t = NULL;
  o.struct_size = offsetof(sg_trainer_options, adjoint_form) + 8;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "0.3 size 272");
  CHECK(t == NULL);
  met.struct_size = offsetof(sg_metrics, adjoint_pairs) + 4;
  t = new_trainer(m, "full");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met), SG_ERR_INVALID_ARGUMENT,
                "0.3 size 200");
  sg_trainer_free(t);
  sg_model_free(m);
}

/* All gradients of the model concatenated (every parameter of `dtype`), malloc'ed; *n gets the count. */
static void* copy_grads_of(sg_model* m, int dtype, size_t elem, int64_t* n) {
  sg_param_info p = sg_param_info_init();
  int64_t i, off = 0;
  char* out;
  *n = 0;
  for (i = 0; i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    CHECK(p.dtype == dtype);
    if (p.grad) *n += p.numel;
  }
  out = (char*)malloc((size_t)*n * elem);
  for (i = 0; out && i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    if (!p.grad) continue;
    memcpy(out + off * elem, p.grad, (size_t)p.numel * elem);
    off += p.numel;
  }
  return out;
}

/* All gradients of an f32 model concatenated, malloc'ed; *n gets the count. */
static float* copy_grads(sg_model* m, int64_t* n) { return (float*)copy_grads_of(m, SG_DTYPE_F32, sizeof(float), n); }

/* Gradients and metrics of one compute_gradients over the test batch with these options. */
static float* grads_with(sg_model* m, const sg_trainer_options* o, sg_metrics* met, int64_t* n) {
  sg_trainer* t = NULL;
  float* g = NULL;
  EXPECT_OK(sg_trainer_create(m, o, &t));
  if (!t) return NULL;
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, met));
  g = copy_grads(m, n);
  sg_trainer_free(t);
  return g;
}

/* The same over 2 sequences of 3 chunks of 8. */
static float* strategy_grads(sg_model* m, const char* strategy, int64_t budget, double cap, uint64_t seed,
                          sg_metrics* met, int64_t* n) {
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = strategy;
  o.chunk = 8;
  o.page_size = 8;
  o.spaco_budget = budget;
  o.spaco_cap = cap;
  o.seed = seed;
  return grads_with(m, &o, met, n);
}

/* seco's gradients over the test batch with pages of 2 tokens (so the last chunk has 6 candidate pages). */
static float* seco_grads(sg_model* m, int64_t sparse_pages, int32_t offload, int64_t* n) {
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = "seco";
  o.chunk = 8;
  o.page_size = 2;
  o.sparse_pages = sparse_pages;
  o.offload = offload;
  return grads_with(m, &o, NULL, n);
}

/* Since 0.6: sparse pages and KV offload on seco. Offload only moves bytes (the same gradient bits, dense or
 * sparse); one selected page changes the gradients; the fields are checked and refused where they do not apply, and
 * a 0.5 caller's struct is read without them. */
static void test_sparse_offload(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  int64_t n[4] = {0, 0, 0, 0};
  float *dense, *dense_off, *sparse, *sparse_off;
  CHECK(o.sparse_pages == 0 && o.offload == 0 && o.num_threads == 0);
  dense = seco_grads(m, 0, 0, &n[0]);
  dense_off = seco_grads(m, 0, 1, &n[1]);
  sparse = seco_grads(m, 1, 0, &n[2]);
  sparse_off = seco_grads(m, 1, 1, &n[3]);
  CHECK(dense && dense_off && sparse && sparse_off && n[0] > 0 && n[1] == n[0] && n[2] == n[0] && n[3] == n[0]);
  if (dense && dense_off && sparse && sparse_off) {
    CHECK(memcmp(dense, dense_off, n[0] * sizeof(float)) == 0);
    CHECK(memcmp(sparse, sparse_off, n[0] * sizeof(float)) == 0);
    CHECK(memcmp(dense, sparse, n[0] * sizeof(float)) != 0);
  }
  free(dense);
  free(dense_off);
  free(sparse);
  free(sparse_off);

  o.chunk = 8;
  o.page_size = 2;
  o.strategy = "ckpt";
  o.offload = 1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->offload is implemented for options->strategy = seco");
  o.strategy = "streambp";
  o.offload = 0;
  o.sparse_pages = 2;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->sparse_pages");
  o.strategy = "seco";
  o.sparse_pages = -1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->sparse_pages must be 0 (dense) or positive");
  o.sparse_pages = 0;
  o.num_threads = -1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->num_threads is -1");
  o.num_threads = 100000;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->num_threads is 100000; need 0 .. 1024");
  o.num_threads = SG_MAX_THREADS + 1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->num_threads");
  o.num_threads = 0;
  CHECK(t == NULL);
  /* 0.5 size: the 0.6 fields beyond it are not read. */
  o.struct_size = offsetof(sg_trainer_options, sparse_pages);
  o.sparse_pages = -1;
  o.offload = 7;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  sg_trainer_free(t);
  sg_model_free(m);
}

/* Since 0.8: offload_experts is refused by name on a model without experts, and a 0.7 caller's struct (whose tail
 * padding is now unused_0_7) is read without it. */
static void test_offload_experts(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  CHECK(o.offload_experts == 0);
  o.offload_experts = 1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT,
                "options->offload_experts: this llama model has no mixture-of-experts layers");
  CHECK(t == NULL);
  o.struct_size = offsetof(sg_trainer_options, offload_experts);
  o.unused_0_7 = 123;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  sg_trainer_free(t);
  sg_model_free(m);
}

static void test_spaco(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics met = sg_metrics_init(), ref = sg_metrics_init();
  float *seco, *g, *again, *other;
  int64_t n = 0, n2 = 0, i;
  int call, differs = 0;

  CHECK(o.spaco_budget == 8 && o.spaco_cap == 2.0 && o.seed == 0);

  /* A random subset of the chunks is backpropagated, afresh on every call; every chunk counts in the loss. */
  o.strategy = "spaco";
  o.chunk = 8;
  o.page_size = 8;
  o.spaco_budget = 1;
  o.seed = 7;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  for (call = 0; call < 4; ++call) {
    met = sg_metrics_init();
    EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    CHECK(met.chunks == 6);
    CHECK(met.chunks_backpropagated >= 0 && met.chunks_backpropagated <= met.chunks);
    CHECK(met.tokens == 2 * (SEQ - 1) && isfinite(met.loss) && met.step == call + 1);
  }
  EXPECT_OK(sg_trainer_optimizer_step(t, &met)); /* reports the chunks of the last compute_gradients */
  CHECK(met.chunks == 6);
  sg_trainer_free(t);

  /* Budget = every chunk, no cap: all chunks kept with compensation 1, i.e. exactly seco. */
  seco = strategy_grads(m, "seco", 8, 2.0, 0, &ref, &n);
  g = strategy_grads(m, "spaco", 3, 0.0, 123, &met, &n2);
  CHECK(seco && g && n == n2 && n > 0);
  CHECK(met.chunks == 6 && met.chunks_backpropagated == 6);
  CHECK(fabs(met.loss - ref.loss) <= 1e-6 * fabs(ref.loss));
  for (i = 0; seco && g && i < n; ++i) {
    if (fabs(g[i] - seco[i]) > 1e-5 * (fabs(seco[i]) + 1e-3)) {
      fprintf(stderr, "spaco gradient [%lld] = %g, seco's %g\n", (long long)i, g[i], seco[i]);
      ++g_failures;
      break;
    }
  }
  free(g);

  /* The seed decides the sample: the same seed gives the same gradients, another one (some call) others. */
  g = strategy_grads(m, "spaco", 1, 2.0, 5, &met, &n);
  again = strategy_grads(m, "spaco", 1, 2.0, 5, &met, &n2);
  CHECK(g && again && n == n2 && memcmp(g, again, (size_t)n * sizeof(float)) == 0);
  for (call = 6; call < 14 && !differs; ++call) {
    other = strategy_grads(m, "spaco", 1, 2.0, (uint64_t)call, &met, &n2);
    differs = other && g && memcmp(g, other, (size_t)n * sizeof(float)) != 0;
    free(other);
  }
  CHECK(differs);
  free(g);
  free(again);
  free(seco);

  /* Bad values name the option. */
  o.spaco_budget = 0;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "spaco_budget");
  CHECK(t == NULL);
  o.spaco_budget = 1;
  o.spaco_cap = 0.5;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "spaco_cap");
  o.spaco_cap = NAN;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "spaco_cap");
  /* A budget above a sequence's chunk count only shows with the batch. */
  o.spaco_cap = 0;
  o.spaco_budget = 4;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_INVALID_ARGUMENT,
                "options->spaco_budget = 4 exceeds the 3 chunks");
  CHECK(sg_trainer_step_count(t) == 0);
  sg_trainer_free(t);
  sg_model_free(m);
}

/* ---- BUSY: thread A is inside its step (in the progress callback) while thread B tries to step. ---- */
typedef struct {
  sg_trainer* t;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int a_in_step;
  int b_done;
  int a_code;
  int b_code;
} busy_ctx;

static void busy_progress(void* user, const sg_progress* p) {
  busy_ctx* c = (busy_ctx*)user;
  (void)p;
  pthread_mutex_lock(&c->mu);
  c->a_in_step = 1;
  pthread_cond_broadcast(&c->cv);
  while (!c->b_done) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}

static void* busy_thread_a(void* arg) {
  busy_ctx* c = (busy_ctx*)arg;
  sg_status* st = sg_trainer_compute_gradients(c->t, g_ids, NULL, SEQ, g_lengths, 1, NULL);
  c->a_code = sg_status_code(st);
  sg_status_free(st);
  return NULL;
}

static void* busy_thread_b(void* arg) {
  busy_ctx* c = (busy_ctx*)arg;
  sg_status* st;
  pthread_mutex_lock(&c->mu);
  while (!c->a_in_step) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  st = sg_trainer_step(c->t, g_ids, NULL, SEQ, g_lengths, 1, NULL);
  c->b_code = sg_status_code(st);
  if (c->b_code == SG_ERR_BUSY) CHECK(strstr(sg_status_message(st), "in use") != NULL);
  sg_status_free(st);
  pthread_mutex_lock(&c->mu);
  c->b_done = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

static void test_busy(void) {
  sg_model* m = tiny_model();
  busy_ctx c;
  pthread_t a, b;
  memset(&c, 0, sizeof c);
  c.t = new_trainer(m, "full");
  pthread_mutex_init(&c.mu, NULL);
  pthread_cond_init(&c.cv, NULL);
  EXPECT_OK(sg_trainer_set_progress_callback(c.t, busy_progress, &c));
  pthread_create(&a, NULL, busy_thread_a, &c);
  pthread_create(&b, NULL, busy_thread_b, &c);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  CHECK(c.a_code == SG_OK);
  CHECK(c.b_code == SG_ERR_BUSY);
  /* After A finished, the trainer is free again. */
  EXPECT_OK(sg_trainer_set_progress_callback(c.t, NULL, NULL));
  EXPECT_OK(sg_trainer_step(c.t, g_ids, NULL, SEQ, g_lengths, 1, NULL));
  pthread_mutex_destroy(&c.mu);
  pthread_cond_destroy(&c.cv);
  sg_trainer_free(c.t);
  sg_model_free(m);
}

/* ---- Cancellation ---- */
typedef struct {
  sg_trainer* t;
  int code;
  int steps;
} cancel_ctx;

static int32_t g_long_ids[512];
static int64_t g_long_len[1] = {512};

static void* cancel_worker(void* arg) {
  cancel_ctx* c = (cancel_ctx*)arg;
  for (c->steps = 0; c->steps < 100000; ++c->steps) {
    sg_status* st = sg_trainer_step(c->t, g_long_ids, NULL, 512, g_long_len, 1, NULL);
    c->code = sg_status_code(st);
    sg_status_free(st);
    if (c->code != SG_OK) break;
  }
  return NULL;
}

static void test_cancel(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = new_trainer(m, "seco");
  cancel_ctx c;
  pthread_t th;
  int i;
  for (i = 0; i < 512; ++i) g_long_ids[i] = (int32_t)((i * 13 + 5) % 97);
  /* Cancel before a step: the next step reports it, the one after runs. */
  sg_trainer_cancel(t);
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, NULL), SG_ERR_CANCELLED, "cancelled");
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, NULL));
  /* Cancel from another thread while it trains. */
  c.t = t;
  c.code = -1;
  c.steps = 0;
  pthread_create(&th, NULL, cancel_worker, &c);
  sleep_ms(30);
  sg_trainer_cancel(t);
  pthread_join(th, NULL);
  CHECK(c.code == SG_ERR_CANCELLED);
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, NULL));
  sg_trainer_free(t);
  sg_model_free(m);
}

/* The first differing gradient beyond rel_tol (relative to |b| + 1e-3) counts as one failure. */
static void expect_close_grads(const float* a, const float* b, int64_t n, double rel_tol, const char* what) {
  int64_t i;
  for (i = 0; a && b && i < n; ++i) {
    if (fabs(a[i] - b[i]) > rel_tol * (fabs(b[i]) + 1e-3)) {
      fprintf(stderr, "%s: gradient [%lld] = %g vs %g\n", what, (long long)i, a[i], b[i]);
      ++g_failures;
      return;
    }
  }
}

/* ---- 0.3: streambp, evaluate, dpo, grpo, memory limit ---- */

static void test_streambp(void) {
  sg_model* m = tiny_model();
  sg_trainer* t;
  sg_metrics met = sg_metrics_init(), ref = sg_metrics_init();
  float *full, *sbp;
  int64_t n = 0, n2 = 0;
  double first = 0;
  int step;
  /* Exact: the same gradients as full backpropagation, with partitions of 8 tokens. */
  full = strategy_grads(m, "full", 8, 2.0, 0, &ref, &n);
  sbp = strategy_grads(m, "streambp", 8, 2.0, 0, &met, &n2);
  CHECK(full && sbp && n == n2 && n > 0);
  CHECK(fabs(met.loss - ref.loss) <= 1e-5 * fabs(ref.loss));
  CHECK(met.tokens == ref.tokens);
  expect_close_grads(sbp, full, n, 1e-5, "streambp vs full");
  free(full);
  free(sbp);
  /* And trains. */
  t = new_trainer(m, "streambp");
  for (step = 0; step < 4; ++step) {
    EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    if (step == 0) first = met.loss;
  }
  CHECK(isfinite(met.loss) && met.loss < first && met.step == 4);
  sg_trainer_free(t);
  sg_model_free(m);
}

static void test_evaluate(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = new_trainer(m, "seco");
  sg_metrics ev = sg_metrics_init(), gr = sg_metrics_init();
  sg_param_info p = sg_param_info_init();
  float before;
  int32_t labels[2 * SEQ];
  int i;
  for (i = 0; i < 2 * SEQ; ++i) labels[i] = (i % 2 == 1) ? g_ids[(i + 3) % (2 * SEQ)] : -100;
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, labels, 2 * SEQ, g_lengths, 2, &gr));
  EXPECT_OK(sg_model_param_info(m, 0, &p));
  before = ((const float*)p.grad)[3];
  EXPECT_OK(sg_trainer_evaluate(t, g_ids, labels, 2 * SEQ, g_lengths, 2, &ev));
  CHECK(fabs(ev.loss - gr.loss) <= 1e-6 * fabs(gr.loss));
  CHECK(ev.tokens == gr.tokens && ev.tokens == SEQ);
  CHECK(ev.chunks == 6 && ev.chunks_backpropagated == 0 && ev.grad_norm == 0 && ev.step == 0);
  CHECK(((const float*)p.grad)[3] == before); /* gradients untouched */
  EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev));
  CHECK(ev.tokens == 2 * (SEQ - 1) && isfinite(ev.loss));
  CHECK(sg_trainer_step_count(t) == 0);
  EXPECT_STATUS(sg_trainer_evaluate(NULL, g_ids, NULL, SEQ, g_lengths, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_evaluate(t, NULL, NULL, SEQ, g_lengths, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'ids'");
  EXPECT_STATUS(sg_trainer_evaluate(t, g_ids, NULL, SEQ, g_lengths, 2, NULL), SG_ERR_INVALID_ARGUMENT, "'lengths'");
  sg_trainer_cancel(t);
  EXPECT_STATUS(sg_trainer_evaluate(t, g_ids, NULL, SEQ, g_lengths, 1, NULL), SG_ERR_CANCELLED, "cancelled");
  EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, SEQ, g_lengths, 1, NULL));
  sg_trainer_free(t);
  sg_model_free(m);
}

/* Prompt + response of `len` tokens: labels (Hugging Face's: the ids themselves) only on the response, the tokens
 * after the first `prompt`. */
#define PR_MAX 32
static void prompt_response(int32_t* ids, int32_t* labels, int len, int prompt, int salt) {
  int t;
  for (t = 0; t < len; ++t) ids[t] = (int32_t)((t * (5 + salt) + 3 * salt + 1) % 90);
  for (t = 0; t < len; ++t) labels[t] = t >= prompt ? ids[t] : -100;
}

static sg_trainer* objective_trainer(sg_model* m, const char* objective, double grpo_kl_beta) {
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = "seco";
  o.chunk = 8;
  o.page_size = 8;
  o.lr = 3e-3;
  o.objective = objective;
  o.grpo_kl_beta = grpo_kl_beta;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  return t;
}

/* Sum of the reference model's log-probs over the labelled tokens of one sequence, through sg_trainer_evaluate. */
static double sequence_logp(sg_trainer* t, const int32_t* ids, const int32_t* labels, int64_t len) {
  sg_metrics met = sg_metrics_init();
  EXPECT_OK(sg_trainer_evaluate(t, ids, labels, len, &len, 1, &met));
  return -met.loss * (double)met.tokens;
}

#define PAIRS 2
static void test_dpo(void) {
  sg_model* policy = tiny_model();
  sg_model* reference = tiny_model(); /* the same preset and seed: a frozen copy */
  sg_model* other_vocab = NULL;
  sg_trainer *sft, *ref_eval, *dpo, *wrong;
  sg_metrics given = sg_metrics_init(), via_model = sg_metrics_init(), mixed = sg_metrics_init();
  int32_t c_ids[PAIRS][PR_MAX], c_lab[PAIRS][PR_MAX], r_ids[PAIRS][PR_MAX], r_lab[PAIRS][PR_MAX];
  const int32_t *ci[PAIRS], *cl[PAIRS], *ri[PAIRS], *rl[PAIRS];
  const int32_t* null_ids[PAIRS] = {NULL, NULL};
  int64_t clen[PAIRS] = {20, 14}, rlen[PAIRS] = {12, 17}, zero_len[PAIRS] = {12, 0};
  double ref_c[PAIRS], ref_r[PAIRS], nan_c[PAIRS], inf_r[PAIRS];
  float *g_given, *g_model;
  int64_t n = 0, n2 = 0;
  int i;
  for (i = 0; i < PAIRS; ++i) {
    prompt_response(c_ids[i], c_lab[i], (int)clen[i], 5, 2 * i + 1);
    prompt_response(r_ids[i], r_lab[i], (int)rlen[i], 5, 2 * i + 2);
    ci[i] = c_ids[i];
    cl[i] = c_lab[i];
    ri[i] = r_ids[i];
    rl[i] = r_lab[i];
  }
  /* Move the policy away from the reference with a few sft steps. */
  sft = new_trainer(policy, "full");
  for (i = 0; i < 3; ++i) EXPECT_OK(sg_trainer_step(sft, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  /* The reference's log-prob sums, through evaluate. */
  ref_eval = new_trainer(reference, "full");
  for (i = 0; i < PAIRS; ++i) {
    ref_c[i] = sequence_logp(ref_eval, c_ids[i], c_lab[i], clen[i]);
    ref_r[i] = sequence_logp(ref_eval, r_ids[i], r_lab[i], rlen[i]);
    CHECK(ref_c[i] < 0 && ref_r[i] < 0);
    nan_c[i] = i == 0 ? NAN : ref_c[i];
    inf_r[i] = i == 1 ? INFINITY : ref_r[i];
  }
  sg_trainer_free(ref_eval);

  dpo = objective_trainer(policy, "dpo", 0.04);
  /* Given reference log-probs vs the same computed by the reference model: the same loss and gradients. */
  EXPECT_OK(sg_trainer_compute_gradients_dpo(dpo, ci, cl, clen, ri, rl, rlen, ref_c, ref_r, PAIRS, &given));
  g_given = copy_grads(policy, &n);
  EXPECT_STATUS(sg_trainer_compute_gradients_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, ref_r, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'ref_chosen_logp' is NULL");
  EXPECT_STATUS(sg_trainer_compute_gradients_dpo(dpo, ci, cl, clen, ri, rl, rlen, nan_c, ref_r, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "ref_chosen_logp[0] is NaN");
  EXPECT_OK(sg_trainer_set_reference(dpo, reference));
  sg_model_free(reference); /* the trainer keeps it */
  EXPECT_OK(sg_trainer_compute_gradients_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, &via_model));
  g_model = copy_grads(policy, &n2);
  CHECK(isfinite(given.loss) && given.loss > 0);
  CHECK(fabs(given.loss - log(2.0)) > 1e-4); /* the policy moved: z != 0 */
  CHECK(fabs(via_model.loss - given.loss) <= 1e-5 * given.loss);
  CHECK(via_model.tokens == given.tokens && given.tokens > 0);
  CHECK(n == n2 && n > 0);
  expect_close_grads(g_model, g_given, n, 1e-5, "dpo: reference model vs given log-probs");
  free(g_given);
  free(g_model);
  /* A NaN entry takes the reference model's value for that pair only. */
  EXPECT_OK(sg_trainer_compute_gradients_dpo(dpo, ci, cl, clen, ri, rl, rlen, nan_c, ref_r, PAIRS, &mixed));
  CHECK(fabs(mixed.loss - given.loss) <= 1e-5 * given.loss);
  /* Steps; next-token labels when the label arrays are NULL. */
  EXPECT_OK(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, &given));
  CHECK(isfinite(given.loss) && given.step == 1 && given.grad_norm > 0);
  EXPECT_OK(sg_trainer_step_dpo(dpo, ci, NULL, clen, ri, rl, rlen, ref_c, ref_r, PAIRS, &given));
  CHECK(isfinite(given.loss) && given.step == 2);
  EXPECT_OK(sg_trainer_optimizer_step(dpo, &given));
  CHECK(given.step == 3);

  /* Errors name the argument. */
  EXPECT_STATUS(sg_trainer_step_dpo(NULL, ci, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, NULL, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'chosen_ids'");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, NULL, ri, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'chosen_lengths'");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, NULL, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'rejected_ids'");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, NULL, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'rejected_lengths'");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, null_ids, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "'rejected_ids[0]' is NULL");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, zero_len, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "rejected_lengths[1] is 0");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, 0, NULL), SG_ERR_INVALID_ARGUMENT,
                "'num_pairs' is 0");
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, ref_c, inf_r, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "ref_rejected_logp[1] is inf");
  c_ids[1][3] = 97;
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "chosen_ids[1][3] = 97");
  c_ids[1][3] = 5;
  for (i = 0; i < PR_MAX; ++i) r_lab[0][i] = -100;
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "rejected_labels[0] has no label");
  prompt_response(r_ids[0], r_lab[0], (int)rlen[0], 5, 2);
  EXPECT_STATUS(sg_trainer_step(dpo, g_ids, NULL, SEQ, g_lengths, 1, NULL), SG_ERR_FAILED_PRECONDITION,
                "objective is 'dpo'");
  EXPECT_STATUS(sg_trainer_step_dpo(sft, ci, cl, clen, ri, rl, rlen, ref_c, ref_r, PAIRS, NULL),
                SG_ERR_FAILED_PRECONDITION, "objective is 'sft'");
  CHECK(sg_trainer_step_count(dpo) == 3); /* none of these stepped */

  /* The reference: not the trainer's own model, the same vocabulary; NULL clears it. */
  EXPECT_STATUS(sg_trainer_set_reference(NULL, policy), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_set_reference(dpo, policy), SG_ERR_INVALID_ARGUMENT, "own model");
  EXPECT_OK(sg_model_create_preset("demo", "f32", 0, &other_vocab));
  EXPECT_STATUS(sg_trainer_set_reference(dpo, other_vocab), SG_ERR_INVALID_ARGUMENT, "vocabulary of 128");
  EXPECT_OK(sg_trainer_set_reference(dpo, NULL));
  EXPECT_STATUS(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, PAIRS, NULL),
                SG_ERR_INVALID_ARGUMENT, "no reference model");
  EXPECT_OK(sg_trainer_step_dpo(dpo, ci, cl, clen, ri, rl, rlen, ref_c, ref_r, PAIRS, NULL));
  /* Other objectives' options are checked too. */
  {
    sg_trainer_options o = sg_trainer_default_options();
    o.objective = "ppo";
    wrong = NULL;
    EXPECT_STATUS(sg_trainer_create(policy, &o, &wrong), SG_ERR_INVALID_ARGUMENT, "options->objective is 'ppo'");
    o.objective = "dpo";
    o.dpo_beta = 0;
    EXPECT_STATUS(sg_trainer_create(policy, &o, &wrong), SG_ERR_INVALID_ARGUMENT, "options->dpo_beta");
    o.dpo_beta = 0.1;
    o.grpo_clip_eps = 1.5;
    EXPECT_STATUS(sg_trainer_create(policy, &o, &wrong), SG_ERR_INVALID_ARGUMENT, "options->grpo_clip_eps");
    o.grpo_clip_eps = 0.2;
    o.grpo_kl_beta = -1;
    EXPECT_STATUS(sg_trainer_create(policy, &o, &wrong), SG_ERR_INVALID_ARGUMENT, "options->grpo_kl_beta");
    o.grpo_kl_beta = 0;
    o.objective = NULL; /* sft */
    EXPECT_OK(sg_trainer_create(policy, &o, &wrong));
    EXPECT_OK(sg_trainer_step(wrong, g_ids, NULL, SEQ, g_lengths, 1, NULL));
    sg_trainer_free(wrong);
  }
  sg_model_free(other_vocab);
  sg_trainer_free(dpo);
  sg_trainer_free(sft);
  sg_model_free(policy);
}

/* While a dpo step runs (here: in its progress callback), its reference model is in use too. */
static sg_model* g_ref_in_use;
static sg_trainer* g_ref_trainer;
static int g_ref_limit_code = -1, g_ref_step_code = -1;
static void reference_in_use(void* user, const sg_progress* p) {
  sg_status* st = sg_model_set_memory_limit(g_ref_in_use, 0);
  (void)user;
  (void)p;
  g_ref_limit_code = sg_status_code(st);
  sg_status_free(st);
  st = sg_trainer_step(g_ref_trainer, g_ids, NULL, SEQ, g_lengths, 1, NULL);
  g_ref_step_code = sg_status_code(st);
  sg_status_free(st);
}

static void test_reference_busy(void) {
  sg_model* policy = tiny_model();
  sg_trainer* dpo = objective_trainer(policy, "dpo", 0.04);
  int32_t c_ids[PR_MAX], c_lab[PR_MAX], r_ids[PR_MAX], r_lab[PR_MAX];
  const int32_t *ci[1] = {c_ids}, *cl[1] = {c_lab}, *ri[1] = {r_ids}, *rl[1] = {r_lab};
  int64_t clen[1] = {16}, rlen[1] = {10};
  prompt_response(c_ids, c_lab, 16, 4, 1);
  prompt_response(r_ids, r_lab, 10, 4, 2);
  g_ref_in_use = tiny_model();
  g_ref_trainer = new_trainer(g_ref_in_use, "full");
  EXPECT_OK(sg_trainer_set_reference(dpo, g_ref_in_use));
  EXPECT_OK(sg_trainer_set_progress_callback(dpo, reference_in_use, NULL));
  EXPECT_OK(sg_trainer_compute_gradients_dpo(dpo, ci, cl, clen, ri, rl, rlen, NULL, NULL, 1, NULL));
  CHECK(g_ref_limit_code == SG_ERR_BUSY);
  CHECK(g_ref_step_code == SG_ERR_BUSY);
  /* Idle again: both work. */
  EXPECT_OK(sg_model_set_memory_limit(g_ref_in_use, 0));
  EXPECT_OK(sg_trainer_step(g_ref_trainer, g_ids, NULL, SEQ, g_lengths, 1, NULL));
  sg_trainer_free(g_ref_trainer);
  sg_trainer_free(dpo);
  sg_model_free(g_ref_in_use);
  sg_model_free(policy);
}

#define COMPLETIONS 5
/* options.grpo_kl_bias_correction: on by default (the KL term times the ratio, TRL's default), off gives another loss,
 * and a caller built before the field (its struct_size) gets the plain k3 it was built for. */
static void test_grpo_kl_bias_correction(sg_model* m, const int32_t* const* ids, const int32_t* const* labels,
                                         const int64_t* len, const double* adv, const double* const* old,
                                         const double* const* ref, const int64_t* offsets) {
  double loss[4];
  int k;
  CHECK(sg_trainer_default_options().grpo_kl_bias_correction == 1);
  for (k = 0; k < 4; ++k) {
    sg_trainer* t = NULL;
    sg_trainer_options o = sg_trainer_default_options();
    sg_metrics met = sg_metrics_init();
    o.objective = "grpo";
    o.grpo_kl_beta = 0.5;
    if (k == 1) o.grpo_kl_bias_correction = 0;
    if (k == 2) o.struct_size = offsetof(sg_trainer_options, grpo_kl_bias_correction);
    if (k == 3) o.grpo_kl_bias_correction = 7; /* nonzero is on */
    EXPECT_OK(sg_trainer_create(m, &o, &t));
    EXPECT_OK(sg_trainer_compute_gradients_grpo(t, ids, labels, len, adv, old, ref, COMPLETIONS, offsets, 2, &met));
    loss[k] = met.loss;
    sg_trainer_free(t);
  }
  CHECK(fabs(loss[0] - loss[1]) > 1e-6 && loss[2] == loss[1] && loss[3] == loss[0]);
}

static void test_grpo(void) {
  sg_model* policy = tiny_model();
  sg_model* reference = tiny_model();
  sg_trainer *grpo, *flat;
  sg_metrics met = sg_metrics_init();
  int32_t ids[COMPLETIONS][PR_MAX], lab[COMPLETIONS][PR_MAX];
  const int32_t *pi[COMPLETIONS], *pl[COMPLETIONS];
  int64_t len[COMPLETIONS] = {18, 12, 15, 20, 9};
  double adv[COMPLETIONS] = {1.0, -0.5, 0.5, 2.0, 0.0}, bad_adv[COMPLETIONS];
  double old_lp[COMPLETIONS][PR_MAX], ref_lp[COMPLETIONS][PR_MAX];
  const double *po[COMPLETIONS], *pr[COMPLETIONS], *none[COMPLETIONS];
  int64_t offsets[3] = {0, 3, 5};            /* groups of 3 and 2 */
  int64_t empty_group[4] = {0, 3, 3, 5};     /* group 1 has no completions */
  int64_t bad_start[3] = {1, 3, 5}, short_end[3] = {0, 3, 4};
  int c, t;
  for (c = 0; c < COMPLETIONS; ++c) {
    prompt_response(ids[c], lab[c], (int)len[c], 4, c + 3);
    pi[c] = ids[c];
    pl[c] = lab[c];
    for (t = 0; t < PR_MAX; ++t) {
      old_lp[c][t] = lab[c][t] >= 0 ? -4.5 + 0.01 * t : NAN; /* NaN where the label is ignored: not read */
      ref_lp[c][t] = lab[c][t] >= 0 ? -4.6 - 0.02 * c : NAN;
    }
    po[c] = old_lp[c];
    pr[c] = ref_lp[c];
    none[c] = NULL;
    bad_adv[c] = c == 2 ? NAN : adv[c];
  }

  /* With r = 1 (no old log-probs) and no KL term, the loss is -(mean over groups of the mean advantage). */
  flat = objective_trainer(policy, "grpo", 0.0);
  EXPECT_OK(sg_trainer_compute_gradients_grpo(flat, pi, pl, len, adv, NULL, NULL, COMPLETIONS, offsets, 2, &met));
  CHECK(fabs(met.loss - (-(1.0 / 3 + 1.0) / 2)) <= 1e-6);
  EXPECT_OK(sg_trainer_step_grpo(flat, pi, NULL, len, adv, none, none, COMPLETIONS, offsets, 2, &met));
  CHECK(isfinite(met.loss) && met.step == 1);
  sg_trainer_free(flat);

  grpo = objective_trainer(policy, "grpo", 0.04);
  EXPECT_OK(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, offsets, 2, &met));
  CHECK(isfinite(met.loss) && met.step == 1 && met.grad_norm > 0);
  /* Reference log-probs from the reference model. */
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, NULL, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "'ref_logprobs' is NULL");
  pr[4] = NULL;
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "ref_logprobs[4] is NULL (group 1 completion 1)");
  pr[4] = ref_lp[4];
  EXPECT_OK(sg_trainer_set_reference(grpo, reference));
  EXPECT_OK(sg_trainer_compute_gradients_grpo(grpo, pi, pl, len, adv, po, NULL, COMPLETIONS, offsets, 2, &met));
  CHECK(isfinite(met.loss) && met.step == 1);
  test_grpo_kl_bias_correction(policy, pi, pl, len, adv, po, pr, offsets);

  /* Errors name the argument (and the group / completion). */
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, empty_group, 3, NULL),
                SG_ERR_INVALID_ARGUMENT, "'group_offsets': group 1 has no completions (G = 0)");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, bad_start, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "group_offsets[0] is 1");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, short_end, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "'num_completions' is 5");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, NULL, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "'group_offsets'");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, offsets, 0, NULL),
                SG_ERR_INVALID_ARGUMENT, "'num_groups' is 0");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, 0, offsets, 2, NULL), SG_ERR_INVALID_ARGUMENT,
                "'num_completions' is 0");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, NULL, pl, len, adv, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "'ids'");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, NULL, adv, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "'lengths'");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, NULL, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "'advantages'");
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, bad_adv, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "advantages[2] is nan");
  old_lp[1][6] = NAN; /* a labelled position */
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "old_logprobs[1][6] is nan (group 0)");
  old_lp[1][6] = -4.0;
  ids[3][2] = -4;
  EXPECT_STATUS(sg_trainer_step_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, offsets, 2, NULL),
                SG_ERR_INVALID_ARGUMENT, "ids[3][2] = -4");
  ids[3][2] = 4;
  EXPECT_STATUS(sg_trainer_step(grpo, g_ids, NULL, SEQ, g_lengths, 1, NULL), SG_ERR_FAILED_PRECONDITION,
                "objective is 'grpo'");
  CHECK(sg_trainer_step_count(grpo) == 1);
  EXPECT_OK(sg_trainer_step_grpo(grpo, pi, pl, len, adv, NULL, NULL, COMPLETIONS, offsets, 2, NULL));
  sg_trainer_free(grpo);
  sg_model_free(reference);
  sg_model_free(policy);
}

static void test_memory_limit(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = new_trainer(m, "seco");
  sg_metrics met = sg_metrics_init();
  CHECK(sg_model_memory_limit(m) == 0);
  CHECK(sg_model_memory_limit(NULL) == -1);
  EXPECT_STATUS(sg_model_set_memory_limit(NULL, 1), SG_ERR_INVALID_ARGUMENT, "'model'");
  EXPECT_STATUS(sg_model_set_memory_limit(m, -1), SG_ERR_INVALID_ARGUMENT, "'bytes' is -1");
  /* Too small for anything: the step fails with the dedicated code and changes nothing. */
  EXPECT_OK(sg_model_set_memory_limit(m, 1024));
  CHECK(sg_model_memory_limit(m) == 1024);
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_RESOURCE_EXHAUSTED,
                "memory limit of 1024 bytes exceeded");
  EXPECT_STATUS(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_RESOURCE_EXHAUSTED,
                "memory limit of 1024 bytes exceeded");
  CHECK(sg_trainer_step_count(t) == 0);
  /* Enough for the gradients but not for AdamW's moments: the optimizer step fails cleanly, before allocating. */
  EXPECT_OK(sg_model_set_memory_limit(m, 0));
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  EXPECT_OK(sg_model_set_memory_limit(m, met.peak_bytes));
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  EXPECT_STATUS(sg_trainer_optimizer_step(t, NULL), SG_ERR_RESOURCE_EXHAUSTED, "optimizer's moments");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_RESOURCE_EXHAUSTED,
                "optimizer's moments");
  CHECK(sg_trainer_step_count(t) == 0);
  /* Limit removed: the model is still usable. */
  EXPECT_OK(sg_model_set_memory_limit(m, 0));
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  CHECK(met.step == 1 && isfinite(met.loss));
  /* Once the moments exist, a limit of exactly what a step needs lets it run. */
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  EXPECT_OK(sg_model_set_memory_limit(m, met.peak_bytes));
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  CHECK(met.step == 3);
  sg_trainer_free(t);
  sg_model_free(m);
}

/* ---- Mamba-1 SSMs through the same ABI ---- */

/* Gradients (f64) and loss of one compute_gradients with `strategy` over the test batch (chunks of 8). */
static double* ssm_grads(sg_model* m, const char* strategy, int64_t spaco_budget, double* loss, int64_t* n) {
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics met = sg_metrics_init();
  double* g = NULL;
  o.strategy = strategy;
  o.chunk = 8;
  o.page_size = 8;
  o.spaco_budget = spaco_budget;
  o.spaco_cap = 0;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  if (!t) return NULL;
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  *loss = met.loss;
  g = (double*)copy_grads_of(m, SG_DTYPE_F64, sizeof(double), n);
  sg_trainer_free(t);
  return g;
}

/* The Mamba-2 models through the C ABI, f64: every exact strategy (spaco with every chunk kept) and adjoint sharding
 * give full's gradients; save -> load (the HF directory transformers reads) gives the same loss. Their match with
 * transformers itself: //tests/torch_ref:mamba2_hf_test. */
static void test_mamba2_models(void) {
  static const char* const kPresets[] = {"tiny-mamba2", "tiny-bamba", "tiny-nemotron-h", "tiny-falcon-h1"};
  static const char* const kStrategies[] = {"ckpt", "seco", "streambp", "spaco", "adjoint"};
  const char* tmp = getenv("TEST_TMPDIR");
  char dir[1024];
  int p, k;
  sg_model *m = NULL, *loaded = NULL;
  sg_trainer* t;
  sg_metrics ev = sg_metrics_init(), ev2 = sg_metrics_init();
  double *full, *g, full_loss = 0, loss = 0;
  int64_t n = 0, n2 = 0, i;
  for (p = 0; p < 4; ++p) {
    m = NULL;
    EXPECT_OK(sg_model_create_preset(kPresets[p], "f64", 3, &m));
    if (!m) continue;
    CHECK(strcmp(sg_model_family(m), "transformer") == 0);
    full = ssm_grads(m, "full", 8, &full_loss, &n);
    CHECK(full && n > 0 && isfinite(full_loss));
    for (k = 0; k < 5; ++k) {
      g = ssm_grads(m, kStrategies[k], 3, &loss, &n2);
      CHECK(g && n2 == n);
      if (fabs(loss - full_loss) > 1e-10 * fabs(full_loss)) {
        fprintf(stderr, "%s %s: loss %.17g vs full %.17g\n", kPresets[p], kStrategies[k], loss, full_loss);
        ++g_failures;
      }
      for (i = 0; g && full && i < n; ++i) {
        if (fabs(g[i] - full[i]) > 1e-10 * (fabs(full[i]) + 1e-3)) {
          fprintf(stderr, "%s %s vs full: gradient [%lld] = %.17g vs %.17g\n", kPresets[p], kStrategies[k],
                  (long long)i, g[i], full[i]);
          ++g_failures;
          break;
        }
      }
      free(g);
    }
    free(full);
    snprintf(dir, sizeof(dir), "%s/%s_saved", tmp ? tmp : "/tmp", kPresets[p]);
    EXPECT_OK(sg_model_save(m, dir));
    loaded = NULL;
    EXPECT_OK(sg_model_load(dir, "f64", &loaded));
    if (loaded) {
      t = new_trainer(m, "seco");
      EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev));
      sg_trainer_free(t);
      t = new_trainer(loaded, "seco");
      EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev2));
      sg_trainer_free(t);
      CHECK(isfinite(ev.loss) && ev.loss == ev2.loss);
    }
    sg_model_free(loaded);
    sg_model_free(m);
  }
}

static void test_ssm(void) {
  static const char* const kStrategies[] = {"ckpt", "seco", "streambp", "spaco"};
  const char* tmp = getenv("TEST_TMPDIR");
  const char* const* names = sg_model_preset_names();
  char dir[1024];
  int found_tiny = 0, found_bench = 0, k, step;
  sg_model *m = NULL, *loaded = NULL;
  sg_trainer* t;
  sg_metrics met = sg_metrics_init(), ev = sg_metrics_init(), ev2 = sg_metrics_init();
  double *full, *g, full_loss = 0, loss = 0, first = 0;
  int64_t n = 0, n2 = 0, i;

  for (; *names; ++names) {
    found_tiny |= strcmp(*names, "tiny-ssm") == 0;
    found_bench |= strcmp(*names, "bench-ssm") == 0;
  }
  CHECK(found_tiny && found_bench);

  /* f64: every exact strategy (and spaco with every chunk kept) gives full's gradients. */
  EXPECT_OK(sg_model_create_preset("tiny-ssm", "f64", 3, &m));
  if (!m) return;
  CHECK(strcmp(sg_model_family(m), "ssm") == 0);
  CHECK(sg_model_vocab_size(m) == 97 && sg_model_num_layers(m) == 3 && sg_model_hidden_size(m) == 16);
  CHECK(sg_model_dtype(m) == SG_DTYPE_F64);
  full = ssm_grads(m, "full", 8, &full_loss, &n);
  CHECK(full && n > 0 && isfinite(full_loss));
  for (k = 0; k < 4; ++k) {
    g = ssm_grads(m, kStrategies[k], 3, &loss, &n2);
    CHECK(g && n2 == n);
    if (fabs(loss - full_loss) > 1e-9 * fabs(full_loss)) {
      fprintf(stderr, "ssm %s: loss %.17g vs full %.17g\n", kStrategies[k], loss, full_loss);
      ++g_failures;
    }
    for (i = 0; g && full && i < n; ++i) {
      if (fabs(g[i] - full[i]) > 1e-9 * (fabs(full[i]) + 1e-3)) {
        fprintf(stderr, "ssm %s vs full: gradient [%lld] = %.17g vs %.17g\n", kStrategies[k], (long long)i, g[i],
                full[i]);
        ++g_failures;
        break;
      }
    }
    free(g);
  }
  free(full);

  /* save -> load (an HF Mamba directory) -> the same family and the same loss. */
  sprintf(dir, "%s/tiny_ssm_saved", tmp ? tmp : "/tmp");
  EXPECT_OK(sg_model_save(m, dir));
  EXPECT_OK(sg_model_load(dir, "f64", &loaded));
  if (loaded) {
    CHECK(strcmp(sg_model_family(loaded), "ssm") == 0);
    CHECK(sg_model_num_params(loaded) == sg_model_num_params(m));
    t = new_trainer(m, "seco");
    EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev));
    sg_trainer_free(t);
    t = new_trainer(loaded, "seco");
    EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev2));
    sg_trainer_free(t);
    CHECK(isfinite(ev.loss) && ev.loss == ev2.loss);
  }
  sg_model_free(loaded);
  sg_model_free(m);

  /* f32: seco and streambp train. */
  for (k = 1; k <= 2; ++k) {
    m = NULL;
    EXPECT_OK(sg_model_create_preset("tiny-ssm", "f32", 5, &m));
    if (!m) continue;
    t = new_trainer(m, kStrategies[k]);
    for (step = 0; step < 5; ++step) {
      EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
      CHECK(isfinite(met.loss));
      if (step == 0) first = met.loss;
    }
    if (!(met.loss < first)) {
      fprintf(stderr, "ssm %s: loss %g after 5 steps, %g at the first\n", kStrategies[k], met.loss, first);
      ++g_failures;
    }
    CHECK(met.step == 5);
    sg_trainer_free(t);
    sg_model_free(m);
  }
}

/* ---- 0.4: adjoint (adjoint sharding for SSMs) ---- */

/* (t, i) pairs per channel summed over layers for the test batch (two sequences of SEQ tokens: SEQ - 1 positions, the
 * last token being only a label), window w. */
static int64_t adjoint_pairs(int64_t layers, int64_t w) {
  const int64_t positions = SEQ - 1;
  if (w > positions) w = positions;
  return 2 * layers * (w * positions - w * (w - 1) / 2);
}

/* Gradients (f64) of one compute_gradients with strategy "adjoint" over the test batch (chunks of `chunk`). */
static double* adjoint_grads(sg_model* m, const char* form, int64_t window, int64_t chunk, sg_metrics* met,
                             int64_t* n) {
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  double* g = NULL;
  o.strategy = "adjoint";
  o.chunk = chunk;
  o.page_size = 8;
  o.adjoint_form = form;
  o.adjoint_window = window;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  if (!t) return NULL;
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, met));
  g = (double*)copy_grads_of(m, SG_DTYPE_F64, sizeof(double), n);
  sg_trainer_free(t);
  return g;
}

/* Over the parameters of m (gradients a and b concatenated as copy_grads_of does): the largest max |a - b| of a
 * parameter relative to its max |b|. The scan parameters' gradients are small next to the embeddings'. */
static double max_param_rel_diff(sg_model* m, const double* a, const double* b) {
  sg_param_info p = sg_param_info_init();
  double worst = 0, diff, scale;
  int64_t i, j, off = 0;
  for (i = 0; i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    if (!p.grad) continue;
    diff = scale = 0;
    for (j = off; j < off + p.numel; ++j) {
      if (fabs(a[j] - b[j]) > diff) diff = fabs(a[j] - b[j]);
      if (fabs(b[j]) > scale) scale = fabs(b[j]);
    }
    if (scale > 0 && diff / scale > worst) worst = diff / scale;
    off += p.numel;
  }
  return worst;
}

static void test_adjoint(void) {
  struct {
    const char* form;
    int64_t window, chunk;
  } exact[] = {{NULL, INT64_MAX, 8}, {"pairs", INT64_MAX, 5}, {"pairs", SEQ, 8}, {"pairs", 1000, 8},
               {"scan", INT64_MAX, 8}};
  sg_model *m = NULL, *tr = NULL;
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics met = sg_metrics_init(), ref = sg_metrics_init();
  double *full = NULL, *g, err;
  int64_t n = 0, n2 = 0, i, layers;
  size_t k;

  CHECK(o.adjoint_form && strcmp(o.adjoint_form, "pairs") == 0 && o.adjoint_window == INT64_MAX);
  EXPECT_OK(sg_model_create_preset("tiny-ssm", "f64", 3, &m));
  if (!m) return;
  layers = sg_model_num_layers(m);
  CHECK(adjoint_pairs(layers, INT64_MAX) == 3 * 2 * ((SEQ - 1) * SEQ / 2));

  /* full as the reference: exact forms and windows at least the sequence give its gradients. */
  o.chunk = 8;
  o.page_size = 8;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  if (t) {
    EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ref));
    full = (double*)copy_grads_of(m, SG_DTYPE_F64, sizeof(double), &n);
    CHECK(ref.adjoint_pairs == 0);
  }
  sg_trainer_free(t);
  t = NULL;
  for (k = 0; full && k < sizeof(exact) / sizeof(exact[0]); ++k) {
    met = sg_metrics_init();
    g = adjoint_grads(m, exact[k].form, exact[k].window, exact[k].chunk, &met, &n2);
    CHECK(g && n2 == n);
    if (fabs(met.loss - ref.loss) > 1e-12 * fabs(ref.loss)) {
      fprintf(stderr, "adjoint case %d: loss %.17g vs full %.17g\n", (int)k, met.loss, ref.loss);
      ++g_failures;
    }
    for (i = 0; g && i < n; ++i) {
      if (fabs(g[i] - full[i]) > 1e-10 * (fabs(full[i]) + 1e-3)) {
        fprintf(stderr, "adjoint case %d vs full: gradient [%lld] = %.17g vs %.17g\n", (int)k, (long long)i, g[i],
                full[i]);
        ++g_failures;
        break;
      }
    }
    if (exact[k].form && strcmp(exact[k].form, "scan") == 0) CHECK(met.adjoint_pairs == 0);
    else CHECK(met.adjoint_pairs == adjoint_pairs(layers, INT64_MAX));
    free(g);
  }

  /* A truncated window drops pairs and changes the gradient (the loss, a forward quantity, stays). */
  met = sg_metrics_init();
  g = adjoint_grads(m, "pairs", 4, 8, &met, &n2);
  CHECK(g && n2 == n);
  CHECK(met.adjoint_pairs == adjoint_pairs(layers, 4) && met.adjoint_pairs == 2 * 3 * (4 * (SEQ - 1) - 6));
  CHECK(fabs(met.loss - ref.loss) <= 1e-12 * fabs(ref.loss));
  if (g && full) {
    err = max_param_rel_diff(m, g, full);
    if (!(err > 1e-3)) {
      fprintf(stderr, "adjoint window 4: gradient equals full's (max rel diff %g)\n", err);
      ++g_failures;
    }
  }
  free(g);
  free(full);

  /* Bad options: SG_ERR_INVALID_ARGUMENT naming the option, nothing created. */
  o = sg_trainer_default_options();
  o.strategy = "adjoint";
  o.adjoint_window = 0;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->adjoint_window is 0");
  CHECK(t == NULL);
  o.adjoint_window = -3;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "adjoint_window is -3");
  o.strategy = "full"; /* checked whatever the strategy */
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "adjoint_window");
  o.strategy = "adjoint";
  o.adjoint_window = INT64_MAX;
  o.adjoint_form = "reverse";
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "adjoint_form is 'reverse'");
  o.adjoint_form = "scan";
  o.adjoint_window = 8;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "scan is exact and has no window");
  CHECK(t == NULL);
  EXPECT_OK(sg_model_create_preset("tiny", "f64", 3, &tr));
  o = sg_trainer_default_options();
  o.strategy = "adjoint";
  EXPECT_STATUS(sg_trainer_create(tr, &o, &t), SG_ERR_INVALID_ARGUMENT, "needs a state-space model");
  CHECK(t == NULL);
  sg_model_free(tr);
  sg_model_free(m);
}

/* ---- 0.5: learning-rate schedule, gradient accumulation, LoRA, checkpoints, detailed evaluation ---- */

static sg_model* tiny_f64(uint64_t seed) {
  sg_model* m = NULL;
  EXPECT_OK(sg_model_create_preset("tiny", "f64", seed, &m));
  return m;
}

/* Options of the 0.5 tests: f64-exact strategies, a cosine schedule. */
static sg_trainer_options schedule_options(const char* strategy) {
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = strategy;
  o.chunk = 8;
  o.page_size = 8;
  o.lr = 1e-2;
  o.lr_schedule = "cosine";
  o.warmup_steps = 2;
  o.min_lr = 1e-3;
  o.total_steps = 6;
  return o;
}

static void test_lr_schedule(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = NULL;
  sg_trainer_options o = schedule_options("seco");
  sg_metrics met = sg_metrics_init();
  /* warmup 1/2, 2/2 of lr; cosine from lr to min_lr over steps 3..6; min_lr after */
  const double pi = 3.14159265358979323846;
  double want[7];
  int s;
  for (s = 1; s <= 7; ++s) {
    double p = s <= 2 ? 0 : (s - 2) / 4.0;
    if (p > 1) p = 1;
    want[s - 1] = s <= 2 ? 1e-2 * s / 2 : 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + cos(pi * p));
  }
  CHECK(strcmp(sg_trainer_default_options().lr_schedule, "constant") == 0);
  CHECK(sg_trainer_default_options().grad_accum == 1 && sg_trainer_default_options().warmup_steps == 0);
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  CHECK(met.lr == 0 && met.micro_batches == 0); /* no optimizer step */
  for (s = 1; s <= 7; ++s) {
    EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    CHECK(fabs(met.lr - want[s - 1]) <= 1e-15);
    CHECK(met.micro_batches == 1 && met.step == s);
  }
  CHECK(met.lr == 1e-3);
  sg_trainer_free(t);
  t = NULL;
  /* A constant schedule (NULL) with warmup. */
  o = sg_trainer_default_options();
  o.lr_schedule = NULL;
  o.warmup_steps = 4;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, &met));
  CHECK(fabs(met.lr - 0.25e-3) < 1e-18);
  sg_trainer_free(t);
  t = NULL;
  /* Bad schedule options, each named. */
  o = schedule_options("full");
  o.lr_schedule = "exponential";
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->lr_schedule 'exponential'");
  o = schedule_options("full");
  o.total_steps = 2;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "total_steps must be larger");
  o = schedule_options("full");
  o.min_lr = 1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->min_lr is 1");
  o = schedule_options("full");
  o.warmup_steps = -1;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->warmup_steps is -1");
  o = schedule_options("full");
  o.grad_accum = 0;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "options->grad_accum is 0");
  CHECK(t == NULL);
  /* Programs built against the 0.4 header: the schedule fields beyond their struct are not read (a constant lr), and
   * 0.4-size metrics leave lr / micro_batches alone. */
  o = schedule_options("full");
  o.struct_size = offsetof(sg_trainer_options, lr_schedule);
  o.lr_schedule = "exponential";
  o.grad_accum = 0;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  met = sg_metrics_init();
  met.struct_size = offsetof(sg_metrics, lr);
  met.lr = -7;
  met.micro_batches = -7;
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, &met));
  CHECK(met.lr == -7 && met.micro_batches == -7 && met.adjoint_pairs == 0 && met.step == 1);
  met.struct_size = offsetof(sg_metrics, lr) + 4;
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, &met), SG_ERR_INVALID_ARGUMENT, "0.4 size 208");
  met = sg_metrics_init();
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, SEQ, g_lengths, 1, &met));
  CHECK(met.lr == 1e-2); /* constant */
  sg_trainer_free(t);
  t = NULL;
  o.struct_size = offsetof(sg_trainer_options, lr_schedule) + 8;
  EXPECT_STATUS(sg_trainer_create(m, &o, &t), SG_ERR_INVALID_ARGUMENT, "0.4 size 288");
  CHECK(t == NULL);
  sg_model_free(m);
}

/* Every parameter of an f64 model concatenated, malloc'ed. */
static double* copy_params_f64(sg_model* m, int64_t* n) {
  sg_param_info p = sg_param_info_init();
  int64_t i, off = 0;
  double* out;
  *n = 0;
  for (i = 0; i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    *n += p.numel;
  }
  out = (double*)malloc((size_t)*n * sizeof(double));
  for (i = 0; out && i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    memcpy(out + off, p.data, (size_t)p.numel * sizeof(double));
    off += p.numel;
  }
  return out;
}

static double max_abs_diff(const double* a, const double* b, int64_t n) {
  double d = 0;
  int64_t i;
  for (i = 0; i < n; ++i)
    if (fabs(a[i] - b[i]) > d) d = fabs(a[i] - b[i]);
  return d;
}

static void test_accumulate(void) {
  sg_model* one = tiny_f64(3);
  sg_model* acc = tiny_f64(3);
  sg_trainer_options o = schedule_options("seco");
  sg_trainer *t1 = NULL, *t2 = NULL;
  sg_metrics m1 = sg_metrics_init(), m2 = sg_metrics_init(), micro = sg_metrics_init();
  int64_t len1[1] = {SEQ}, n1 = 0, n2 = 0;
  double *p1, *p2;
  int step;
  o.grad_accum = 2;
  EXPECT_OK(sg_trainer_create(one, &o, &t1));
  EXPECT_OK(sg_trainer_create(acc, &o, &t2));
  /* Two micro-batches of one sequence each, accumulated, equal one step on both sequences. */
  for (step = 1; step <= 3; ++step) {
    EXPECT_OK(sg_trainer_step(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m1));
    EXPECT_OK(sg_trainer_accumulate_gradients(t2, g_ids, NULL, SEQ, len1, 1, &micro));
    CHECK(micro.tokens == SEQ - 1 && micro.micro_batches == 0 && micro.lr == 0 && micro.step == step - 1);
    EXPECT_OK(sg_trainer_accumulate_gradients(t2, g_ids + SEQ, NULL, SEQ, len1, 1, NULL));
    CHECK(sg_trainer_step_count(t2) == step - 1);
    EXPECT_OK(sg_trainer_optimizer_step(t2, &m2));
    CHECK(m2.micro_batches == 2 && m2.tokens == m1.tokens && m2.step == step && m2.lr == m1.lr);
    CHECK(fabs(m2.loss - m1.loss) <= 1e-12 * fabs(m1.loss));
    CHECK(fabs(m2.grad_norm - m1.grad_norm) <= 1e-10 * m1.grad_norm);
  }
  p1 = copy_params_f64(one, &n1);
  p2 = copy_params_f64(acc, &n2);
  CHECK(n1 == n2 && p1 && p2 && max_abs_diff(p1, p2, n1) <= 1e-12);
  free(p1);
  free(p2);
  /* compute_gradients drops a pending accumulation: the next optimizer step uses its batch alone. */
  EXPECT_OK(sg_trainer_accumulate_gradients(t2, g_ids, NULL, SEQ, len1, 1, NULL));
  EXPECT_OK(sg_trainer_compute_gradients(t2, g_ids + SEQ, NULL, SEQ, len1, 1, &micro));
  EXPECT_OK(sg_trainer_optimizer_step(t2, &m2));
  CHECK(m2.micro_batches == 1 && m2.tokens == SEQ - 1 && m2.loss == micro.loss);
  /* Errors of the accumulate calls are those of compute_gradients. */
  EXPECT_STATUS(sg_trainer_accumulate_gradients(NULL, g_ids, NULL, SEQ, len1, 1, NULL), SG_ERR_INVALID_ARGUMENT,
                "'trainer'");
  EXPECT_STATUS(sg_trainer_accumulate_gradients(t2, NULL, NULL, SEQ, len1, 1, NULL), SG_ERR_INVALID_ARGUMENT,
                "sg_trainer_accumulate_gradients: argument 'ids'");
  EXPECT_STATUS(sg_trainer_accumulate_gradients(t2, g_ids, NULL, SEQ, len1, 2, NULL), SG_ERR_INVALID_ARGUMENT,
                "'lengths'");
  EXPECT_STATUS(sg_trainer_accumulate_gradients_dpo(t2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, NULL),
                SG_ERR_FAILED_PRECONDITION, "objective is 'sft'");
  EXPECT_STATUS(sg_trainer_accumulate_gradients_grpo(t2, NULL, NULL, NULL, NULL, NULL, NULL, 1, NULL, 1, NULL),
                SG_ERR_FAILED_PRECONDITION, "objective is 'sft'");
  sg_trainer_free(t1);
  sg_trainer_free(t2);
  sg_model_free(one);
  sg_model_free(acc);
}

/* DPO pairs accumulated one at a time equal one step on both (reference log-probs given). */
static void test_accumulate_dpo(void) {
  sg_model* one = tiny_f64(4);
  sg_model* acc = tiny_f64(4);
  sg_trainer *t1 = NULL, *t2 = NULL, *sft = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics m1 = sg_metrics_init(), m2 = sg_metrics_init();
  int32_t c_ids[PAIRS][PR_MAX], c_lab[PAIRS][PR_MAX], r_ids[PAIRS][PR_MAX], r_lab[PAIRS][PR_MAX];
  const int32_t *ci[PAIRS], *cl[PAIRS], *ri[PAIRS], *rl[PAIRS];
  int64_t clen[PAIRS] = {20, 14}, rlen[PAIRS] = {12, 17};
  double ref_c[PAIRS] = {-40.5, -30.25}, ref_r[PAIRS] = {-25.0, -35.75};
  int i;
  for (i = 0; i < PAIRS; ++i) {
    prompt_response(c_ids[i], c_lab[i], (int)clen[i], 5, 2 * i + 1);
    prompt_response(r_ids[i], r_lab[i], (int)rlen[i], 5, 2 * i + 2);
    ci[i] = c_ids[i];
    cl[i] = c_lab[i];
    ri[i] = r_ids[i];
    rl[i] = r_lab[i];
  }
  o.objective = "dpo";
  o.strategy = "full";
  EXPECT_OK(sg_trainer_create(one, &o, &t1));
  EXPECT_OK(sg_trainer_create(acc, &o, &t2));
  EXPECT_OK(sg_trainer_step_dpo(t1, ci, cl, clen, ri, rl, rlen, ref_c, ref_r, PAIRS, &m1));
  for (i = 0; i < PAIRS; ++i)
    EXPECT_OK(sg_trainer_accumulate_gradients_dpo(t2, ci + i, cl + i, clen + i, ri + i, rl + i, rlen + i, ref_c + i,
                                                  ref_r + i, 1, NULL));
  EXPECT_OK(sg_trainer_optimizer_step(t2, &m2));
  CHECK(m2.micro_batches == 2 && fabs(m2.loss - m1.loss) <= 1e-12 && fabs(m2.grad_norm - m1.grad_norm) <= 1e-10);
  EXPECT_STATUS(sg_trainer_accumulate_gradients(t2, g_ids, NULL, SEQ, g_lengths, 1, NULL),
                SG_ERR_FAILED_PRECONDITION, "objective is 'dpo'");
  o = sg_trainer_default_options();
  EXPECT_OK(sg_trainer_create(one, &o, &sft));
  EXPECT_STATUS(sg_trainer_accumulate_gradients_dpo(sft, ci, cl, clen, ri, rl, rlen, ref_c, ref_r, PAIRS, NULL),
                SG_ERR_FAILED_PRECONDITION, "objective is 'sft'");
  sg_trainer_free(sft);
  sg_trainer_free(t1);
  sg_trainer_free(t2);
  sg_model_free(one);
  sg_model_free(acc);
}

static int file_exists(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) return 0;
  fclose(f);
  return 1;
}

static void tmp_path(char* out, size_t size, const char* name) {
  const char* tmp = getenv("TEST_TMPDIR");
  snprintf(out, size, "%s/%s", tmp ? tmp : "/tmp", name);
}

/* Expects `st` to fail with `code`, its message naming `path` and ending with strerror's text for `err`; frees it. */
static void expect_errno(sg_status* st, int code, const char* path, const char* strerror_text, int line) {
  const char* msg = sg_status_message(st);
  const size_t n = strlen(msg), k = strlen(strerror_text);
  if (sg_status_code(st) != code || !strstr(msg, path) || n < k || strcmp(msg + n - k, strerror_text) != 0) {
    fprintf(stderr, "line %d: expected %s naming '%s' and ending with '%s', got %s: %s\n", line, sg_code_name(code),
            path, strerror_text, sg_code_name(sg_status_code(st)), msg);
    ++g_failures;
  }
  sg_status_free(st);
}
#define EXPECT_ERRNO(st, code, path, text) expect_errno((st), (code), (path), (text), __LINE__)

/* One errno, one code: saving a model or a checkpoint, loading a model, a checkpoint or an adapter into a path that
 * cannot be used fail with the same code, the path and strerror's text. */
static void test_errno_codes(void) {
  sg_model* m = tiny_model();
  sg_model* none = NULL;
  sg_trainer* t = new_trainer(m, "full");
  char file[1024], under_file[1100], missing[1024];
  FILE* f;
  struct {
    const char* path;
    int code;
    const char* text;
  } cases[3];
  int i;
  tmp_path(file, sizeof(file), "c_errno_regular_file");
  snprintf(under_file, sizeof(under_file), "%s/sub", file);
  tmp_path(missing, sizeof(missing), "c_errno_missing/sub");
  f = fopen(file, "w");
  CHECK(f != NULL);
  if (f) fclose(f);
  cases[0].path = "/proc/seqgrad-x"; /* mkdir there: ENOENT */
  cases[0].code = SG_ERR_NOT_FOUND;
  cases[0].text = "No such file or directory";
  cases[1].path = under_file; /* ENOTDIR */
  cases[1].code = SG_ERR_FAILED_PRECONDITION;
  cases[1].text = "Not a directory";
  cases[2].path = missing; /* loads only: saves create it */
  cases[2].code = SG_ERR_NOT_FOUND;
  cases[2].text = "No such file or directory";
  for (i = 0; i < 3; ++i) {
    const char* p = cases[i].path;
    if (i < 2) {
      EXPECT_ERRNO(sg_model_save(m, p), cases[i].code, p, cases[i].text);
      EXPECT_ERRNO(sg_trainer_save_checkpoint(t, p, 0, 0), cases[i].code, p, cases[i].text);
    }
    EXPECT_ERRNO(sg_model_load(p, "f32", &none), cases[i].code, p, cases[i].text);
    EXPECT_ERRNO(sg_model_load_lora_adapter(m, p), cases[i].code, p, cases[i].text);
    EXPECT_ERRNO(sg_trainer_load_checkpoint(t, p, NULL, NULL), cases[i].code, p, cases[i].text);
  }
  CHECK(none == NULL);
  remove(file);
  sg_trainer_free(t);
  sg_model_free(m);
}

static void test_lora(void) {
  sg_model* m = tiny_f64(5);
  sg_model* fresh = NULL;
  sg_model* other = NULL;
  sg_model* merged = NULL;
  sg_trainer* t = NULL;
  sg_trainer* t2 = NULL;
  sg_lora_options lo = sg_lora_default_options(), info = sg_lora_default_options();
  sg_trainer_options o = sg_trainer_default_options();
  sg_param_info p = sg_param_info_init();
  sg_metrics met = sg_metrics_init(), ev1 = sg_metrics_init(), ev2 = sg_metrics_init();
  const int64_t base_params = sg_model_num_params(m);
  char adapter[1024], file[1100], merged_dir[1024];
  int64_t i, with_grad = 0;
  int step;
  FILE* f;
  CHECK(lo.struct_size == sizeof(sg_lora_options) && lo.rank == 8 && lo.alpha == 0 && lo.targets == NULL);
  EXPECT_OK(sg_model_lora(m, &info));
  CHECK(info.rank == 0 && info.targets == NULL);
  /* Bad options, named; the model stays without LoRA. */
  lo.rank = 0;
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_INVALID_ARGUMENT, "options->rank is 0");
  lo = sg_lora_default_options();
  lo.dropout = 1;
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_INVALID_ARGUMENT, "options->dropout is 1");
  lo = sg_lora_default_options();
  lo.alpha = -2;
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_INVALID_ARGUMENT, "options->alpha is -2");
  lo = sg_lora_default_options();
  lo.targets = "q_proj,x_proj";
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_INVALID_ARGUMENT, "options->targets: 'x_proj'");
  lo.targets = "q_proj,q_proj";
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_INVALID_ARGUMENT, "listed twice");
  lo.struct_size = 8;
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_INVALID_ARGUMENT, "struct_size");
  EXPECT_STATUS(sg_model_enable_lora(NULL, &lo), SG_ERR_INVALID_ARGUMENT, "'model'");
  EXPECT_STATUS(sg_model_enable_lora(m, NULL), SG_ERR_INVALID_ARGUMENT, "'options'");
  CHECK(sg_model_num_params(m) == base_params);
  /* Not under a trainer (its optimizer state would not match). */
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  lo = sg_lora_default_options();
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_FAILED_PRECONDITION, "before creating trainers");
  sg_trainer_free(t);
  t = NULL;
  EXPECT_STATUS(sg_model_save_lora_adapter(m, "/tmp/never", NULL), SG_ERR_FAILED_PRECONDITION, "not enabled");

  lo.rank = 4;
  lo.alpha = 8;
  lo.dropout = 0.1;
  lo.targets = "q_proj, v_proj,o_proj";
  lo.seed = 9;
  EXPECT_OK(sg_model_enable_lora(m, &lo));
  EXPECT_STATUS(sg_model_enable_lora(m, &lo), SG_ERR_FAILED_PRECONDITION, "already enabled");
  EXPECT_OK(sg_model_lora(m, &info));
  CHECK(info.rank == 4 && info.alpha == 8 && info.dropout == 0.1 && info.seed == 9);
  CHECK(info.targets && strcmp(info.targets, "q_proj,v_proj,o_proj") == 0);
  /* 3 layers x 3 modules x (A, B) adapters; base parameters frozen. */
  CHECK(sg_model_num_params(m) == base_params + 18);
  o = schedule_options("seco");
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  for (step = 0; step < 4; ++step) EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  for (i = 0; i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    CHECK((p.grad != NULL) == (strstr(p.name, ".lora_") != NULL));
    with_grad += p.grad != NULL;
    if (i == base_params) CHECK(strcmp(p.name, "model.layers.0.self_attn.q_proj.lora_A.weight") == 0);
  }
  CHECK(with_grad == 18);
  CHECK(met.peak_bytes_by_category[2] > 0); /* AdamW moments of the adapters */

  /* PEFT adapter files; loading them into a fresh copy of the base enables LoRA with the adapter's options and gives
   * the same function. */
  tmp_path(adapter, sizeof(adapter), "c_adapter");
  EXPECT_OK(sg_model_save_lora_adapter(m, adapter, "seqgrad/tiny"));
  snprintf(file, sizeof(file), "%s/adapter_config.json", adapter);
  CHECK(file_exists(file));
  snprintf(file, sizeof(file), "%s/adapter_model.safetensors", adapter);
  CHECK(file_exists(file));
  fresh = tiny_f64(5);
  EXPECT_OK(sg_model_load_lora_adapter(fresh, adapter));
  EXPECT_OK(sg_model_lora(fresh, &info));
  CHECK(info.rank == 4 && info.alpha == 8 && strcmp(info.targets, "q_proj,v_proj,o_proj") == 0);
  o = sg_trainer_default_options();
  EXPECT_OK(sg_trainer_create(fresh, &o, &t2));
  EXPECT_OK(sg_trainer_evaluate(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev1));
  EXPECT_OK(sg_trainer_evaluate(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev2));
  CHECK(fabs(ev1.loss - ev2.loss) <= 1e-12); /* another chunking than t's: rounding only */
  /* Loading again into a model with LoRA on (and a trainer): the values only. */
  EXPECT_OK(sg_model_load_lora_adapter(fresh, adapter));
  sg_trainer_free(t2);
  t2 = NULL;

  /* sg_model_save writes the merged weights: a plain HF model with the same function and no adapters. */
  tmp_path(merged_dir, sizeof(merged_dir), "c_merged");
  EXPECT_OK(sg_model_save(m, merged_dir));
  EXPECT_OK(sg_model_load(merged_dir, "f64", &merged));
  CHECK(sg_model_num_params(merged) == base_params);
  EXPECT_OK(sg_trainer_create(merged, &o, &t2));
  EXPECT_OK(sg_trainer_evaluate(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ev2));
  CHECK(fabs(ev1.loss - ev2.loss) <= 1e-12);
  sg_trainer_free(t2);
  t2 = NULL;

  /* Bad adapters: another base model's (shapes named), a missing directory, a truncated file, another rank. */
  EXPECT_OK(sg_model_create_preset("demo", "f64", 0, &other));
  EXPECT_STATUS(sg_model_load_lora_adapter(other, adapter), SG_ERR_INVALID_ARGUMENT, "different base model");
  EXPECT_OK(sg_model_lora(other, &info));
  CHECK(info.rank == 0);
  EXPECT_STATUS(sg_model_load_lora_adapter(other, "/nonexistent/adapter"), SG_ERR_NOT_FOUND, "not a directory");
  EXPECT_STATUS(sg_model_load_lora_adapter(other, NULL), SG_ERR_INVALID_ARGUMENT, "'dir'");
  sg_model_free(other);
  other = tiny_f64(5);
  lo.rank = 2;
  EXPECT_OK(sg_model_enable_lora(other, &lo));
  EXPECT_STATUS(sg_model_load_lora_adapter(other, adapter), SG_ERR_INVALID_ARGUMENT, "r 4 vs 2");
  sg_model_free(other);
  snprintf(file, sizeof(file), "%s/adapter_model.safetensors", adapter);
  f = fopen(file, "r+b");
  CHECK(f != NULL);
  if (f) {
    fseek(f, 0, SEEK_END);
    CHECK(ftruncate(fileno(f), ftell(f) / 2) == 0);
    fclose(f);
  }
  other = tiny_f64(5);
  EXPECT_STATUS(sg_model_load_lora_adapter(other, adapter), SG_ERR_INVALID_ARGUMENT, "adapter_model.safetensors");
  sg_model_free(other);

  sg_trainer_free(t);
  sg_model_free(merged);
  sg_model_free(fresh);
  sg_model_free(m);
}

/* A trainer of the checkpoint tests: tiny f64 with LoRA (dropout), seco, a cosine schedule. */
static sg_trainer* checkpoint_trainer(sg_model** model, int64_t chunk) {
  sg_trainer* t = NULL;
  sg_trainer_options o = schedule_options("seco");
  sg_lora_options lo = sg_lora_default_options();
  lo.rank = 4;
  lo.dropout = 0.1;
  *model = tiny_f64(6);
  EXPECT_OK(sg_model_enable_lora(*model, &lo));
  o.chunk = chunk;
  o.total_steps = 8;
  EXPECT_OK(sg_trainer_create(*model, &o, &t));
  return t;
}

/* Batch `k` of the checkpoint tests: the test batch shifted by k tokens. */
static void checkpoint_batch(int k, int32_t* ids) {
  int i;
  for (i = 0; i < 2 * SEQ; ++i) ids[i] = g_ids[(i + 5 * k) % (2 * SEQ)];
}

static void corrupt_byte(const char* path, long offset) {
  FILE* f = fopen(path, "r+b");
  int c;
  CHECK(f != NULL);
  if (!f) return;
  fseek(f, offset, SEEK_SET);
  c = fgetc(f);
  fseek(f, offset, SEEK_SET);
  fputc(c ^ 0x5A, f);
  fclose(f);
}

static void test_checkpoint(void) {
  char dir[1024], ckpt[1100], file[1200], empty[1024];
  sg_model *m1, *m2, *m3;
  sg_trainer *t1, *t2, *t3;
  sg_metrics met = sg_metrics_init();
  int32_t ids[2 * SEQ];
  double uninterrupted[6];
  int64_t step = -1, position = -1;
  int k;
  FILE* f;
  struct stat st;
  tmp_path(dir, sizeof(dir), "c_checkpoints");
  tmp_path(empty, sizeof(empty), "c_no_checkpoints");
  /* Uninterrupted: 6 steps. Interrupted: 3 steps, a checkpoint, then a new process (model, trainer) resumes. */
  t1 = checkpoint_trainer(&m1, 8);
  for (k = 0; k < 6; ++k) {
    checkpoint_batch(k, ids);
    EXPECT_OK(sg_trainer_step(t1, ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    uninterrupted[k] = met.loss;
  }
  t2 = checkpoint_trainer(&m2, 8);
  for (k = 0; k < 3; ++k) {
    checkpoint_batch(k, ids);
    EXPECT_OK(sg_trainer_step(t2, ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    CHECK(met.loss == uninterrupted[k]);
    if (k == 0) EXPECT_OK(sg_trainer_save_checkpoint(t2, dir, 1, 2));
  }
  EXPECT_OK(sg_trainer_save_checkpoint(t2, dir, 3, 2));
  snprintf(ckpt, sizeof(ckpt), "%s/checkpoint-3", dir);
  snprintf(file, sizeof(file), "%s/trainer_state.json", ckpt);
  CHECK(file_exists(file));
  sg_trainer_free(t2);
  sg_model_free(m2);

  t2 = checkpoint_trainer(&m2, 8);
  EXPECT_OK(sg_trainer_resume(t2, dir, &step, &position));
  CHECK(step == 3 && position == 3 && sg_trainer_step_count(t2) == 3);
  for (k = (int)position; k < 6; ++k) {
    checkpoint_batch(k, ids);
    EXPECT_OK(sg_trainer_step(t2, ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    CHECK(met.loss == uninterrupted[k]); /* bit-identical */
    CHECK(met.step == k + 1);
  }
  /* keep = 2: saving steps 1, 3 and 6 leaves 3 and 6. */
  EXPECT_OK(sg_trainer_save_checkpoint(t2, dir, 6, 2));
  snprintf(file, sizeof(file), "%s/checkpoint-1", dir);
  CHECK(stat(file, &st) != 0);
  snprintf(file, sizeof(file), "%s/checkpoint-6", dir);
  CHECK(stat(file, &st) == 0);
  /* load_checkpoint of a given one: back to step 3. */
  EXPECT_OK(sg_trainer_load_checkpoint(t2, ckpt, &step, NULL));
  CHECK(step == 3 && sg_trainer_step_count(t2) == 3);
  EXPECT_OK(sg_trainer_load_checkpoint(t2, ckpt, NULL, NULL));

  /* A differing run configuration is refused, listing the fields. */
  t3 = checkpoint_trainer(&m3, 16);
  EXPECT_STATUS(sg_trainer_resume(t3, dir, &step, NULL), SG_ERR_FAILED_PRECONDITION,
                "strategy.chunk: checkpoint '8', now '16'");
  CHECK(sg_trainer_step_count(t3) == 0);
  sg_trainer_free(t3);
  sg_model_free(m3);
  /* Without LoRA the parameters differ too. */
  {
    sg_trainer_options o = schedule_options("seco");
    o.total_steps = 8;
    m3 = tiny_f64(6);
    EXPECT_OK(sg_trainer_create(m3, &o, &t3));
    EXPECT_STATUS(sg_trainer_load_checkpoint(t3, ckpt, NULL, NULL), SG_ERR_FAILED_PRECONDITION, "lora.rank");
    sg_trainer_free(t3);
    sg_model_free(m3);
  }

  /* Damaged checkpoints: DATA_LOSS naming the file; resume skips a damaged newest one. */
  snprintf(file, sizeof(file), "%s/checkpoint-6/model.safetensors", dir);
  corrupt_byte(file, 200);
  snprintf(ckpt, sizeof(ckpt), "%s/checkpoint-6", dir);
  EXPECT_STATUS(sg_trainer_load_checkpoint(t2, ckpt, NULL, NULL), SG_ERR_DATA_LOSS, "CRC-32 mismatch");
  EXPECT_OK(sg_trainer_resume(t2, dir, &step, &position));
  CHECK(step == 3 && position == 3);
  snprintf(file, sizeof(file), "%s/checkpoint-3/optimizer.safetensors", dir);
  f = fopen(file, "r+b");
  CHECK(f != NULL);
  if (f) {
    CHECK(ftruncate(fileno(f), 100) == 0);
    fclose(f);
  }
  snprintf(ckpt, sizeof(ckpt), "%s/checkpoint-3", dir);
  EXPECT_STATUS(sg_trainer_load_checkpoint(t2, ckpt, NULL, NULL), SG_ERR_DATA_LOSS, "truncated");
  EXPECT_STATUS(sg_trainer_resume(t2, dir, &step, NULL), SG_ERR_NOT_FOUND, "skipped damaged");
  snprintf(file, sizeof(file), "%s/checkpoint-3/trainer_state.json", dir);
  corrupt_byte(file, 30);
  EXPECT_STATUS(sg_trainer_load_checkpoint(t2, ckpt, NULL, NULL), SG_ERR_DATA_LOSS, "trainer_state.json");
  EXPECT_STATUS(sg_trainer_resume(t2, empty, &step, NULL), SG_ERR_NOT_FOUND, "no complete checkpoint");
  EXPECT_STATUS(sg_trainer_load_checkpoint(t2, empty, NULL, NULL), SG_ERR_NOT_FOUND, "not a directory");

  /* Arguments. */
  EXPECT_STATUS(sg_trainer_save_checkpoint(NULL, dir, 0, 0), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_save_checkpoint(t2, NULL, 0, 0), SG_ERR_INVALID_ARGUMENT, "'out_dir'");
  EXPECT_STATUS(sg_trainer_save_checkpoint(t2, dir, -1, 0), SG_ERR_INVALID_ARGUMENT, "'data_position' is -1");
  EXPECT_STATUS(sg_trainer_save_checkpoint(t2, dir, 0, -1), SG_ERR_INVALID_ARGUMENT, "'keep' is -1");
  EXPECT_STATUS(sg_trainer_load_checkpoint(t2, NULL, NULL, NULL), SG_ERR_INVALID_ARGUMENT, "'checkpoint_dir'");
  EXPECT_STATUS(sg_trainer_resume(NULL, dir, NULL, NULL), SG_ERR_INVALID_ARGUMENT, "'trainer'");
  EXPECT_STATUS(sg_trainer_resume(t2, NULL, NULL, NULL), SG_ERR_INVALID_ARGUMENT, "'out_dir'");
  /* Still trains. */
  EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  sg_trainer_free(t1);
  sg_trainer_free(t2);
  sg_model_free(m1);
  sg_model_free(m2);
}

static void test_evaluate_detailed(void) {
  sg_model* m = tiny_f64(7);
  sg_trainer* t = new_trainer(m, "seco");
  sg_eval_result r = sg_eval_result_init();
  sg_metrics ev = sg_metrics_init();
  int32_t labels[2 * SEQ];
  int64_t distances[2 * SEQ];
  int64_t sum = 0;
  int i;
  for (i = 0; i < 2 * SEQ; ++i) {
    labels[i] = (i % 3 == 1) ? g_ids[(i + 1) % (2 * SEQ)] : -100;
    distances[i] = labels[i] >= 0 ? 1 + i % 11 : -5; /* ignored where the label is -100 */
  }
  CHECK(r.struct_size == sizeof(sg_eval_result));
  EXPECT_OK(sg_trainer_evaluate_detailed(t, g_ids, labels, 2 * SEQ, g_lengths, 2, distances, &r));
  EXPECT_OK(sg_trainer_evaluate(t, g_ids, labels, 2 * SEQ, g_lengths, 2, &ev));
  CHECK(r.sequences == 2 && r.tokens == 16 && r.tokens == ev.tokens);
  CHECK(fabs(r.loss - ev.loss) <= 1e-12 && fabs(r.perplexity - exp(r.loss)) <= 1e-9 * r.perplexity);
  CHECK(r.correct >= 0 && r.correct <= r.tokens && r.accuracy == (double)r.correct / (double)r.tokens);
  CHECK(r.num_buckets == 4 && r.peak_bytes > 0 && r.seconds > 0); /* distances 1..11: buckets [1,2) .. [8,16) */
  for (i = 0; i < r.num_buckets; ++i) {
    sum += r.bucket_count[i];
    CHECK(r.bucket_correct[i] <= r.bucket_count[i]);
    CHECK(r.bucket_count[i] == 0 || r.bucket_loss[i] > 0);
  }
  CHECK(sum == r.tokens && r.bucket_count[4] == 0);
  /* Without distances: no buckets; the training state is untouched. */
  EXPECT_OK(sg_trainer_evaluate_detailed(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, &r));
  CHECK(r.num_buckets == 0 && r.tokens == 2 * (SEQ - 1) && sg_trainer_step_count(t) == 0);
  distances[4] = 0;
  EXPECT_STATUS(sg_trainer_evaluate_detailed(t, g_ids, labels, 2 * SEQ, g_lengths, 2, distances, &r),
                SG_ERR_INVALID_ARGUMENT, "distances[4] is 0");
  distances[4] = 5;
  distances[0] = -1; /* a sequence's position 0 is never predicted: its label and distance are not read */
  distances[SEQ] = -1;
  labels[0] = labels[SEQ] = 7;
  EXPECT_OK(sg_trainer_evaluate_detailed(t, g_ids, labels, 2 * SEQ, g_lengths, 2, distances, &r));
  CHECK(r.tokens == 16);
  EXPECT_STATUS(sg_trainer_evaluate_detailed(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, NULL),
                SG_ERR_INVALID_ARGUMENT, "'out'");
  EXPECT_STATUS(sg_trainer_evaluate_detailed(NULL, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, &r),
                SG_ERR_INVALID_ARGUMENT, "'trainer'");
  r.struct_size = 16;
  EXPECT_STATUS(sg_trainer_evaluate_detailed(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, &r),
                SG_ERR_INVALID_ARGUMENT, "struct_size");
  r = sg_eval_result_init();
  sg_trainer_cancel(t);
  EXPECT_STATUS(sg_trainer_evaluate_detailed(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, &r), SG_ERR_CANCELLED,
                "cancelled");
  sg_trainer_free(t);
  sg_model_free(m);
}

/* NaN/Inf guard: a non-finite weight stops the step with the step and the tensor named. */
static void test_nonfinite_guard(void) {
  sg_model* m = tiny_model();
  sg_trainer* t = new_trainer(m, "full");
  sg_param_info p = sg_param_info_init();
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  EXPECT_OK(sg_model_param_info(m, 1, &p));
  ((float*)p.data)[2] = (float)NAN;
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_INTERNAL, "at step 2");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL), SG_ERR_INTERNAL, p.name);
  CHECK(sg_trainer_step_count(t) == 1);
  sg_trainer_free(t);
  sg_model_free(m);
}

/* ---- 0.7: Hugging Face labels, per-token log-probs, threads ---- */

static sg_trainer* f64_trainer(sg_model* m, const char* strategy, int64_t chunk, int64_t lm_chunk, int threads) {
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = strategy;
  o.chunk = chunk;
  o.page_size = 4;
  o.lm_chunk = lm_chunk;
  o.num_threads = threads;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  return t;
}

static double* f64_grads(sg_trainer* t, sg_model* m, const int32_t* ids, const int32_t* labels, int64_t n_tok,
                         const int64_t* lengths, int64_t n_seq, double* loss, int64_t* n) {
  sg_metrics met = sg_metrics_init();
  EXPECT_OK(sg_trainer_compute_gradients(t, ids, labels, n_tok, lengths, n_seq, &met));
  *loss = met.loss;
  return (double*)copy_grads_of(m, SG_DTYPE_F64, sizeof(double), n);
}

/* Labels follow Hugging Face: labels = ids trains exactly as NULL (next-token) labels; the previous convention's
 * pre-shifted labels now train something else; a masked prompt leaves exactly its response tokens labelled. */
static void test_hf_labels(void) {
  sg_model* m = tiny_f64(11);
  sg_trainer* t = f64_trainer(m, "seco", 8, 256, 0);
  int32_t same[2 * SEQ], preshifted[2 * SEQ], masked[2 * SEQ];
  double loss_null, loss_same, loss_pre, lp[2 * SEQ], sum = 0;
  double *g_null, *g_same, *g_pre;
  int64_t n1 = 0, n2 = 0, n3 = 0;
  sg_metrics met = sg_metrics_init();
  int i;
  for (i = 0; i < 2 * SEQ; ++i) {
    same[i] = g_ids[i];
    preshifted[i] = (i % SEQ) + 1 < SEQ ? g_ids[i + 1] : -100; /* the 0.6 convention: target of position i */
    masked[i] = i % SEQ < 10 ? -100 : g_ids[i];                 /* a 10-token prompt per sequence */
  }
  g_null = f64_grads(t, m, g_ids, NULL, 2 * SEQ, g_lengths, 2, &loss_null, &n1);
  g_same = f64_grads(t, m, g_ids, same, 2 * SEQ, g_lengths, 2, &loss_same, &n2);
  g_pre = f64_grads(t, m, g_ids, preshifted, 2 * SEQ, g_lengths, 2, &loss_pre, &n3);
  CHECK(n1 > 0 && n1 == n2 && n1 == n3);
  CHECK(loss_null == loss_same && memcmp(g_null, g_same, (size_t)n1 * sizeof(double)) == 0);
  CHECK(fabs(loss_pre - loss_null) > 1e-3 && max_abs_diff(g_pre, g_null, n1) > 1e-6);
  free(g_null);
  free(g_same);
  free(g_pre);
  /* The masked prompt: tokens 10..23 of each sequence are labelled (the loss is their mean -log p). */
  EXPECT_OK(sg_trainer_evaluate(t, g_ids, masked, 2 * SEQ, g_lengths, 2, &met));
  CHECK(met.tokens == 2 * (SEQ - 10));
  EXPECT_OK(sg_trainer_score(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, lp, NULL));
  for (i = 0; i < 2 * SEQ; ++i)
    if (i % SEQ >= 10) sum += lp[i];
  CHECK(fabs(-sum / (2 * (SEQ - 10)) - met.loss) <= 1e-12 * met.loss);
  sg_trainer_free(t);
  sg_model_free(m);
}

/* sg_trainer_score: position t's entry is log p(labels[t] | ids[0..t)), so changing ids[k] leaves the entries up
 * to k unchanged and changes entry k + 1 (an off-by-one either way breaks one of the two); the same values at every
 * chunk and LM-head chunk size, for both families; NaN where there is no label; the sum is evaluate's. */
static void test_score(void) {
  static const char* const kPresets[2] = {"tiny", "tiny-ssm"};
  static const int64_t kChunks[3][2] = {{1, 1}, {5, 3}, {8, 256}};
  int32_t labels[2 * SEQ], ids2[2 * SEQ];
  double ref[2 * SEQ], lp[2 * SEQ], sum = 0;
  int f, c, i, k;
  for (f = 0; f < 2; ++f) {
    sg_model* m = NULL;
    sg_trainer *whole, *t;
    sg_metrics met = sg_metrics_init(), ev = sg_metrics_init();
    int64_t labelled = 0;
    EXPECT_OK(sg_model_create_preset(kPresets[f], "f64", 2, &m));
    for (i = 0; i < 2 * SEQ; ++i) labels[i] = i % 5 == 2 ? -100 : g_ids[(i * 3) % (2 * SEQ)];
    whole = f64_trainer(m, "full", 2 * SEQ, 2 * SEQ, 0); /* one chunk, one LM-head block */
    EXPECT_OK(sg_trainer_score(whole, g_ids, labels, 2 * SEQ, g_lengths, 2, ref, &met));
    sum = 0;
    for (i = 0; i < 2 * SEQ; ++i) {
      const int want = i % SEQ != 0 && labels[i] != -100;
      CHECK(want ? (isfinite(ref[i]) && ref[i] < 0) : isnan(ref[i]));
      if (want) sum += ref[i], ++labelled;
    }
    EXPECT_OK(sg_trainer_evaluate(whole, g_ids, labels, 2 * SEQ, g_lengths, 2, &ev));
    CHECK(met.tokens == labelled && ev.tokens == labelled && fabs(met.loss - ev.loss) <= 1e-12 * ev.loss);
    CHECK(fabs(-sum / (double)labelled - ev.loss) <= 1e-12 * ev.loss);
    for (c = 0; c < 3; ++c) {
      t = f64_trainer(m, f == 0 ? "seco" : "full", kChunks[c][0], kChunks[c][1], 0);
      EXPECT_OK(sg_trainer_score(t, g_ids, labels, 2 * SEQ, g_lengths, 2, lp, NULL));
      for (i = 0; i < 2 * SEQ; ++i) {
        CHECK(isnan(lp[i]) == isnan(ref[i]));
        if (!isnan(ref[i]) && !(fabs(lp[i] - ref[i]) <= 1e-12 * fabs(ref[i])))
          fprintf(stderr, "%s chunk %d lm_chunk %d position %d: %.17g vs %.17g\n", kPresets[f], (int)kChunks[c][0],
                  (int)kChunks[c][1], i, lp[i], ref[i]), ++g_failures;
      }
      sg_trainer_free(t);
    }
    /* Causality and alignment. */
    for (k = 3; k < SEQ - 1; k += 7) {
      memcpy(ids2, g_ids, sizeof(ids2));
      ids2[k] = (g_ids[k] + 1) % 50;
      EXPECT_OK(sg_trainer_score(whole, ids2, labels, 2 * SEQ, g_lengths, 2, lp, NULL));
      for (i = 0; i <= k; ++i) CHECK(isnan(ref[i]) ? isnan(lp[i]) : lp[i] == ref[i]);
      CHECK(labels[k + 1] == -100 || fabs(lp[k + 1] - ref[k + 1]) > 1e-9);
      for (i = SEQ; i < 2 * SEQ; ++i) CHECK(isnan(ref[i]) ? isnan(lp[i]) : lp[i] == ref[i]); /* the other sequence */
    }
    /* NULL labels = ids; no label at all is allowed (all NaN); errors name the argument. */
    {
      int32_t none[2 * SEQ];
      for (i = 0; i < 2 * SEQ; ++i) none[i] = -100;
      EXPECT_OK(sg_trainer_score(whole, g_ids, none, 2 * SEQ, g_lengths, 2, lp, &met));
      for (i = 0; i < 2 * SEQ; ++i) CHECK(isnan(lp[i]));
      CHECK(met.tokens == 0);
    }
    EXPECT_STATUS(sg_trainer_score(whole, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, NULL), SG_ERR_INVALID_ARGUMENT,
                  "'logprobs'");
    EXPECT_STATUS(sg_trainer_score(NULL, g_ids, NULL, 2 * SEQ, g_lengths, 2, lp, NULL), SG_ERR_INVALID_ARGUMENT,
                  "'trainer'");
    EXPECT_STATUS(sg_trainer_score(whole, g_ids, NULL, 2 * SEQ, g_lengths, 1, lp, NULL), SG_ERR_INVALID_ARGUMENT,
                  "'lengths'");
    CHECK(sg_trainer_step_count(whole) == 0);
    sg_trainer_free(whole);
    sg_model_free(m);
  }
}

/* GRPO's old-policy and reference log-probs from sg_trainer_score are what the objective computes itself: the same
 * loss and gradients as with the reference model (ref) and as with r = 1 (old = the current policy). */
static void test_grpo_score(void) {
  sg_model* policy = tiny_f64(3);
  sg_model* reference = tiny_f64(5);
  sg_trainer* grpo = NULL;
  sg_trainer *score_ref = f64_trainer(reference, "seco", 8, 256, 0), *score_pol = f64_trainer(policy, "seco", 8, 256, 0);
  sg_trainer_options o = sg_trainer_default_options();
  sg_metrics a = sg_metrics_init(), b = sg_metrics_init();
  int32_t ids[COMPLETIONS][PR_MAX], lab[COMPLETIONS][PR_MAX];
  const int32_t *pi[COMPLETIONS], *pl[COMPLETIONS];
  int64_t len[COMPLETIONS] = {18, 12, 15, 20, 9}, offsets[3] = {0, 3, 5};
  double adv[COMPLETIONS] = {1.0, -0.5, 0.5, 2.0, 0.3};
  double ref_lp[COMPLETIONS][PR_MAX], old_lp[COMPLETIONS][PR_MAX];
  const double *pr[COMPLETIONS], *po[COMPLETIONS];
  double *g_a, *g_b;
  int64_t na = 0, nb = 0;
  int c;
  for (c = 0; c < COMPLETIONS; ++c) {
    prompt_response(ids[c], lab[c], (int)len[c], 4, c + 3);
    pi[c] = ids[c];
    pl[c] = lab[c];
    EXPECT_OK(sg_trainer_score(score_ref, ids[c], lab[c], len[c], &len[c], 1, ref_lp[c], NULL));
    EXPECT_OK(sg_trainer_score(score_pol, ids[c], lab[c], len[c], &len[c], 1, old_lp[c], NULL));
    pr[c] = ref_lp[c];
    po[c] = old_lp[c];
  }
  o.strategy = "seco";
  o.chunk = 8;
  o.page_size = 4;
  o.objective = "grpo";
  o.grpo_kl_beta = 0.5;
  EXPECT_OK(sg_trainer_create(policy, &o, &grpo));
  EXPECT_OK(sg_trainer_set_reference(grpo, reference));
  EXPECT_OK(sg_trainer_compute_gradients_grpo(grpo, pi, pl, len, adv, NULL, NULL, COMPLETIONS, offsets, 2, &a));
  g_a = (double*)copy_grads_of(policy, SG_DTYPE_F64, sizeof(double), &na);
  EXPECT_OK(sg_trainer_compute_gradients_grpo(grpo, pi, pl, len, adv, po, pr, COMPLETIONS, offsets, 2, &b));
  g_b = (double*)copy_grads_of(policy, SG_DTYPE_F64, sizeof(double), &nb);
  CHECK(na == nb && na > 0 && isfinite(a.loss));
  CHECK(fabs(a.loss - b.loss) <= 1e-12 * fabs(a.loss));
  CHECK(max_abs_diff(g_a, g_b, na) <= 1e-12);
  /* Aligned as before 0.7 (entry t for the label of position t + 1) they give another loss. */
  for (c = 0; c < COMPLETIONS; ++c) {
    int t;
    for (t = 0; t < len[c]; ++t) old_lp[c][t] = t + 1 < len[c] ? ref_lp[c][t + 1] : -1.0;
    pr[c] = old_lp[c];
  }
  EXPECT_OK(sg_trainer_compute_gradients_grpo(grpo, pi, pl, len, adv, NULL, pr, COMPLETIONS, offsets, 2, &b));
  CHECK(fabs(a.loss - b.loss) > 1e-6);
  free(g_a);
  free(g_b);
  sg_trainer_free(grpo);
  sg_trainer_free(score_ref);
  sg_trainer_free(score_pol);
  sg_model_free(reference);
  sg_model_free(policy);
}

/* num_threads: any count trains (the sums split differently: equal to rounding); checkpoints record it, and a
 * resume with another count is not refused but warned about on stderr. */
/* --dtype=bf16 through the C ABI: bf16 weight matrices over f32 compute, training works, weights take about half,
 * fp32 masters are reported in their own category; Mamba too; saves in bf16 or f32. */
static void test_bf16(void) {
  sg_model *m = NULL, *f32 = tiny_model(), *ssm = NULL, *loaded = NULL;
  sg_trainer *t, *tf;
  sg_metrics met = sg_metrics_init(), met32 = sg_metrics_init();
  sg_param_info p = sg_param_info_init(), q = sg_param_info_init();
  double first = 0;
  int step;
  char dir[1024];
  EXPECT_OK(sg_model_create_preset("tiny", "bf16", 1, &m));
  CHECK(sg_model_dtype(m) == SG_DTYPE_F32);
  EXPECT_OK(sg_model_param_info(m, 0, &p));
  CHECK(p.dtype == SG_DTYPE_BF16 && p.grad != NULL);
  t = new_trainer(m, "seco");
  tf = new_trainer(f32, "seco");
  for (step = 0; step < 4; ++step) {
    EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
    if (step == 0) first = met.loss;
  }
  EXPECT_OK(sg_trainer_step(tf, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met32));
  CHECK(isfinite(met.loss) && met.loss < first);
  CHECK(2 * met.peak_bytes_by_category[0] < 1.05 * met32.peak_bytes_by_category[0]); /* weights */
  CHECK(met.peak_bytes_master_weights > 0 && met32.peak_bytes_master_weights == 0);
  CHECK(met.peak_bytes_master_weights < met.peak_bytes_by_category[2]); /* the moments: twice the masters and more */

  /* Saved as stored (bf16 matrices) or in f32; both load back into bf16 with the same bits. */
  tmp_path(dir, sizeof(dir), "c_bf16_f32");
  EXPECT_OK(sg_model_save_as(m, dir, "f32"));
  EXPECT_OK(sg_model_load(dir, "bf16", &loaded));
  EXPECT_OK(sg_model_param_info(loaded, 0, &q));
  CHECK(q.dtype == SG_DTYPE_BF16 && memcmp(p.data, q.data, (size_t)q.numel * 2) == 0);
  sg_model_free(loaded);
  EXPECT_OK(sg_model_load(dir, "f32", &loaded));
  EXPECT_OK(sg_model_param_info(loaded, 0, &q));
  CHECK(q.dtype == SG_DTYPE_F32);
  sg_model_free(loaded);
  tmp_path(dir, sizeof(dir), "c_bf16_bf16");
  EXPECT_OK(sg_model_save_as(m, dir, NULL));
  EXPECT_OK(sg_model_save_as(m, dir, "bf16"));
  EXPECT_STATUS(sg_model_save_as(m, dir, "f16"), SG_ERR_INVALID_ARGUMENT, "argument 'dtype'");
  EXPECT_STATUS(sg_model_save_as(f32, dir, "bf16"), SG_ERR_INVALID_ARGUMENT, "argument 'dtype' is bf16");
  EXPECT_STATUS(sg_model_save_as(m, NULL, "f32"), SG_ERR_INVALID_ARGUMENT, "'dir'");

  EXPECT_OK(sg_model_create_preset("tiny-ssm", "bf16", 1, &ssm));
  EXPECT_OK(sg_model_param_info(ssm, 0, &q));
  CHECK(q.dtype == SG_DTYPE_BF16);
  sg_trainer_free(t);
  t = new_trainer(ssm, "seco");
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, &met));
  CHECK(isfinite(met.loss) && met.peak_bytes_master_weights > 0);
  sg_model_free(ssm);
  sg_trainer_free(t);
  sg_trainer_free(tf);
  sg_model_free(m);
  sg_model_free(f32);
}

static void test_threads(void) {
  sg_model* m = tiny_f64(8);
  sg_trainer* t1 = f64_trainer(m, "seco", 8, 256, 1);
  sg_trainer* t3 = f64_trainer(m, "seco", 8, 256, 3);
  double loss1, loss3, *g1, *g3;
  int64_t n1 = 0, n3 = 0, step = -1;
  char dir[1024], log[1100], text[4096];
  FILE* f;
  size_t got;
  int saved_stderr;
  g1 = f64_grads(t1, m, g_ids, NULL, 2 * SEQ, g_lengths, 2, &loss1, &n1);
  g3 = f64_grads(t3, m, g_ids, NULL, 2 * SEQ, g_lengths, 2, &loss3, &n3);
  CHECK(n1 == n3 && fabs(loss1 - loss3) <= 1e-12 * loss1 && max_abs_diff(g1, g3, n1) <= 1e-12);
  free(g1);
  free(g3);
  EXPECT_OK(sg_trainer_step(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL));
  tmp_path(dir, sizeof(dir), "threads_ckpt");
  EXPECT_OK(sg_trainer_save_checkpoint(t1, dir, 1, 0));
  snprintf(log, sizeof(log), "%s.stderr", dir);
  fflush(stderr);
  saved_stderr = dup(2);
  CHECK(freopen(log, "w", stderr) != NULL);
  EXPECT_OK(sg_trainer_resume(t3, dir, &step, NULL));
  fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  f = fopen(log, "r");
  got = f ? fread(text, 1, sizeof(text) - 1, f) : 0;
  text[got] = 0;
  if (f) fclose(f);
  CHECK(step == 1);
  CHECK(strstr(text, "runtime.threads: checkpoint '1', now '3'") != NULL && strstr(text, "not bit-identically"));
  sg_trainer_free(t1);
  sg_trainer_free(t3);
  sg_model_free(m);
}

/* sg_model_options.frozen_base (0.8): the model is created without gradients, LoRA then trains exactly as on a
 * model created whole; a 0.7-sized options struct leaves the base trainable. */
static void test_frozen_base(void) {
  sg_model_options mo = sg_model_default_options();
  sg_model *frozen = NULL, *whole = NULL, *old = NULL;
  sg_trainer *tf = NULL, *tw = NULL;
  sg_trainer_options o = schedule_options("seco");
  sg_lora_options lo = sg_lora_default_options();
  sg_param_info p = sg_param_info_init();
  sg_metrics mf = sg_metrics_init(), mw = sg_metrics_init();
  int64_t i;
  int step;
  CHECK(mo.frozen_base == 0);
  mo.dtype = "f64";
  mo.seed = 5;
  mo.frozen_base = 1;
  EXPECT_OK(sg_model_create_preset_with("tiny", &mo, &frozen));
  for (i = 0; i < sg_model_num_params(frozen); ++i) {
    EXPECT_OK(sg_model_param_info(frozen, i, &p));
    CHECK(p.grad == NULL);
  }
  /* Nothing to train without adapters: refused before any work. */
  EXPECT_OK(sg_trainer_create(frozen, &o, &tf));
  EXPECT_STATUS(sg_trainer_step(tf, g_ids, NULL, 2 * SEQ, g_lengths, 2, &mf), SG_ERR_FAILED_PRECONDITION,
                "frozen_base");
  sg_trainer_free(tf);
  /* offload_experts at creation needs a frozen base and experts. */
  mo.offload_experts = 1;
  EXPECT_STATUS(sg_model_create_preset_with("tiny", &mo, &old), SG_ERR_INVALID_ARGUMENT,
                "options->offload_experts: this llama model has no mixture-of-experts layers");
  mo.frozen_base = 0;
  EXPECT_STATUS(sg_model_create_preset_with("tiny-qwen3-moe", &mo, &old), SG_ERR_INVALID_ARGUMENT,
                "options->offload_experts keeps the expert weights in host memory");
  mo.frozen_base = 1;
  EXPECT_OK(sg_model_create_preset_with("tiny-qwen3-moe", &mo, &old));
  sg_model_free(old);
  mo.offload_experts = 0;
  /* A 0.7 caller's struct has no frozen_base: the model is whole. */
  mo.struct_size = 32;
  EXPECT_OK(sg_model_create_preset_with("tiny", &mo, &old));
  EXPECT_OK(sg_model_param_info(old, 0, &p));
  CHECK(p.grad != NULL);
  sg_model_free(old);
  whole = tiny_f64(5);
  lo.rank = 4;
  lo.targets = "q_proj,v_proj";
  EXPECT_OK(sg_model_enable_lora(frozen, &lo));
  EXPECT_OK(sg_model_enable_lora(whole, &lo));
  EXPECT_OK(sg_trainer_create(frozen, &o, &tf));
  EXPECT_OK(sg_trainer_create(whole, &o, &tw));
  for (step = 0; step < 3; ++step) {
    EXPECT_OK(sg_trainer_step(tf, g_ids, NULL, 2 * SEQ, g_lengths, 2, &mf));
    EXPECT_OK(sg_trainer_step(tw, g_ids, NULL, 2 * SEQ, g_lengths, 2, &mw));
    CHECK(mf.loss == mw.loss);
  }
  sg_trainer_free(tf);
  sg_trainer_free(tw);
  sg_model_free(frozen);
  sg_model_free(whole);
}

int main(void) {
  make_batch();
  test_version();
  test_lifecycle();
  test_bf16();
  test_errors();
  test_errno_codes();
  test_old_struct_sizes();
  test_spaco();
  test_busy();
  test_cancel();
  test_streambp();
  test_evaluate();
  test_dpo();
  test_reference_busy();
  test_grpo();
  test_memory_limit();
  test_ssm();
  test_mamba2_models();
  test_adjoint();
  test_lr_schedule();
  test_accumulate();
  test_accumulate_dpo();
  test_lora();
  test_frozen_base();
  test_checkpoint();
  test_evaluate_detailed();
  test_nonfinite_guard();
  test_sparse_offload();
  test_offload_experts();
  test_hf_labels();
  test_score();
  test_grpo_score();
  test_threads();
  if (g_failures) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("all seqgrad C tests passed\n");
  return 0;
}
