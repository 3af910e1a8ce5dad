/* C99 tests of the seqgrad C API: the full lifecycle and every error path, through the public header only. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "seqgrad/seqgrad.h"

static int g_failures = 0;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

/* Checks that `st` has `code` and that its message contains `needle`; frees it. */
static void expect_status(sg_status* st, int code, const char* needle, int line) {
  if (sg_status_code(st) != code || (needle && !strstr(sg_status_message(st), needle))) {
    fprintf(stderr, "line %d: expected %s containing '%s', got %s: %s\n", line, sg_code_name(code),
            needle ? needle : "", sg_code_name(sg_status_code(st)), sg_status_message(st));
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
  CHECK(sg_memory_category_name(SG_NUM_MEMORY_CATEGORIES) == NULL);
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
    for (i = 0; i < 2 * SEQ; ++i) labels[i] = (i % 3 == 0) ? g_ids[(i + 1) % (2 * SEQ)] : -100;
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
  o.struct_size = sizeof(o) - 8;
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
  met.struct_size = 4;
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len4, 1, &met), SG_ERR_INVALID_ARGUMENT, "struct_size");
  met.struct_size = sizeof(met) - 8;
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
  EXPECT_STATUS(sg_trainer_step(t, g_ids, ignored, 4, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "all -100");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len_bad, 2, NULL), SG_ERR_INVALID_ARGUMENT, "'lengths'");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len_zero, 2, NULL), SG_ERR_INVALID_ARGUMENT, "lengths[1]");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 4, len4, 0, NULL), SG_ERR_INVALID_ARGUMENT, "'num_sequences'");
  EXPECT_STATUS(sg_trainer_step(t, g_ids, NULL, 0, len4, 1, NULL), SG_ERR_INVALID_ARGUMENT, "'num_tokens'");
  /* Still usable after all that. */
  EXPECT_OK(sg_trainer_step(t, g_ids, NULL, 4, len4, 1, NULL));
  sg_trainer_free(t);
  sg_model_free(m);
}

/* A program built against the 0.1 header (options and metrics end before the 0.2 fields) keeps working. */
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
                "spaco_budget=8 exceeds the 3 chunks");
  sg_trainer_free(t);
  sg_model_free(m);
}

/* All gradients of the model concatenated (f32), malloc'ed; *n gets the count. */
static float* copy_grads(sg_model* m, int64_t* n) {
  sg_param_info p = sg_param_info_init();
  int64_t i, off = 0;
  float* out;
  *n = 0;
  for (i = 0; i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    if (p.grad) *n += p.numel;
  }
  out = (float*)malloc((size_t)*n * sizeof(float));
  for (i = 0; out && i < sg_model_num_params(m); ++i) {
    EXPECT_OK(sg_model_param_info(m, i, &p));
    if (!p.grad) continue;
    memcpy(out + off, p.grad, (size_t)p.numel * sizeof(float));
    off += p.numel;
  }
  return out;
}

/* Gradients and metrics of one compute_gradients over the test batch (2 sequences of 3 chunks of 8). */
static float* spaco_grads(sg_model* m, const char* strategy, int64_t budget, double cap, uint64_t seed,
                          sg_metrics* met, int64_t* n) {
  sg_trainer* t = NULL;
  sg_trainer_options o = sg_trainer_default_options();
  float* g = NULL;
  o.strategy = strategy;
  o.chunk = 8;
  o.page_size = 8;
  o.spaco_budget = budget;
  o.spaco_cap = cap;
  o.seed = seed;
  EXPECT_OK(sg_trainer_create(m, &o, &t));
  if (!t) return NULL;
  EXPECT_OK(sg_trainer_compute_gradients(t, g_ids, NULL, 2 * SEQ, g_lengths, 2, met));
  g = copy_grads(m, n);
  sg_trainer_free(t);
  return g;
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
  seco = spaco_grads(m, "seco", 8, 2.0, 0, &ref, &n);
  g = spaco_grads(m, "spaco", 3, 0.0, 123, &met, &n2);
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
  g = spaco_grads(m, "spaco", 1, 2.0, 5, &met, &n);
  again = spaco_grads(m, "spaco", 1, 2.0, 5, &met, &n2);
  CHECK(g && again && n == n2 && memcmp(g, again, (size_t)n * sizeof(float)) == 0);
  for (call = 6; call < 14 && !differs; ++call) {
    other = spaco_grads(m, "spaco", 1, 2.0, (uint64_t)call, &met, &n2);
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
                "spaco_budget=4 exceeds the 3 chunks");
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

int main(void) {
  make_batch();
  test_version();
  test_lifecycle();
  test_errors();
  test_old_struct_sizes();
  test_spaco();
  test_busy();
  test_cancel();
  if (g_failures) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("all seqgrad C tests passed\n");
  return 0;
}
