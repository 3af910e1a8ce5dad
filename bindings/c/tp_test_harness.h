/* What the C API's tensor-parallel tests share (seqgrad_tp_test.c, seqgrad_tp_dp_test.c, seqgrad_tp_cuda_test.c):
 * checks that count failures on this rank, the "demo" preset in fp64, and the comparison of one parameter between
 * two models. */
#ifndef SEQGRAD_BINDINGS_C_TP_TEST_HARNESS_H_
#define SEQGRAD_BINDINGS_C_TP_TEST_HARNESS_H_

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seqgrad/seqgrad.h"

static int g_failures = 0;
static int g_rank = 0;

#define CHECK(cond)                                                                             \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      fprintf(stderr, "rank %d: %s:%d: CHECK failed: %s\n", g_rank, __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                             \
    }                                                                                           \
  } while (0)

static void expect_status(sg_status* st, int code, const char* needle, int line) {
  if (sg_status_code(st) != code || (needle && !strstr(sg_status_message(st), needle))) {
    fprintf(stderr, "rank %d line %d: expected %s containing '%s', got %s: %s\n", g_rank, line, sg_code_name(code),
            needle ? needle : "", sg_code_name(sg_status_code(st)), sg_status_message(st));
    ++g_failures;
  } else if (st) {
    printf("rank %d: refused as expected: %s\n", g_rank, sg_status_message(st));
  }
  sg_status_free(st);
}
#define EXPECT_STATUS(st, code, needle) expect_status((st), (code), (needle), __LINE__)
#define EXPECT_OK(st) expect_status((st), SG_OK, NULL, __LINE__)

static inline int close_within(double a, double b, double scale, double tol) {
  return fabs(a - b) <= tol * (scale > 0 ? scale : 1);
}
static inline int close_rel(double a, double b, double scale) { return close_within(a, b, scale, 1e-12); }

static inline sg_model* demo(void) {
  sg_model* m = NULL;
  EXPECT_OK(sg_model_create_preset("demo", "f64", 7, &m));
  return m;
}

/* Sets g_rank (mpirun's OMPI_COMM_WORLD_RANK) and fills ids with the tests' tokens; returns the directory for files. */
static inline const char* start_rank(int32_t* ids, int n) {
  const char* rank_env = getenv("OMPI_COMM_WORLD_RANK");
  const char* tmp = getenv("TEST_TMPDIR");
  g_rank = rank_env ? atoi(rank_env) : 0;
  for (int i = 0; i < n; ++i) ids[i] = (int32_t)((i * 37 + 11) % 128);
  return tmp ? tmp : "/tmp";
}

/* The tests' trainer: seco in chunks of 16, pages of 8, lr 1e-2, options.tp = tp. */
static inline sg_trainer_options seco_options(int64_t tp) {
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = "seco";
  o.chunk = 16;
  o.page_size = 8;
  o.lr = 1e-2;
  o.tp = tp;
  return o;
}

/* Whether parameter i's values (grad = 0) or gradients agree in both models: ||x - y|| <= tol ||x|| (the
 * distributed tests' measure: an AdamW step divides by sqrt(v), which magnifies rounding in near-zero entries).
 * Copied out through sg_model_read_param, so either model may be on a device. */
static int same_tensor_within(sg_model* a, sg_model* b, int64_t i, int grad, double tol) {
  sg_param_info pa = sg_param_info_init(), pb = sg_param_info_init();
  EXPECT_OK(sg_model_param_info(a, i, &pa));
  EXPECT_OK(sg_model_param_info(b, i, &pb));
  if (strcmp(pa.name, pb.name) != 0 || pa.numel != pb.numel) return 0;
  if (grad && (!pa.grad || !pb.grad)) return !pa.grad && !pb.grad;
  const size_t bytes = (size_t)pa.numel * sizeof(double);
  double* x = (double*)malloc(bytes);
  double* y = (double*)malloc(bytes);
  int same = 0;
  if (x && y) {
    EXPECT_OK(sg_model_read_param(a, i, grad ? SG_PARAM_GRAD : SG_PARAM_VALUE, x, bytes));
    EXPECT_OK(sg_model_read_param(b, i, grad ? SG_PARAM_GRAD : SG_PARAM_VALUE, y, bytes));
    double norm = 0, diff = 0;
    for (int64_t k = 0; k < pa.numel; ++k) {
      norm += x[k] * x[k];
      diff += (x[k] - y[k]) * (x[k] - y[k]);
    }
    same = sqrt(diff) <= tol * sqrt(norm);
    if (!same)
      fprintf(stderr, "rank %d: %s%s differs: relative %.3g\n", g_rank, pa.name, grad ? ".grad" : "",
              sqrt(diff / norm));
  }
  free(x);
  free(y);
  return same;
}
static inline int same_tensor(sg_model* a, sg_model* b, int64_t i, int grad) {
  return same_tensor_within(a, b, i, grad, 1e-12);
}

/* Saves (collective: rank 0 writes `tp`'s whole model) of both models under tmp, loaded back on the CPU: the same
 * tensors within tol. */
static inline void check_same_saves(sg_model* one, sg_model* tp, const char* tmp, double tol) {
  char dir_tp[512], dir_one[512];
  snprintf(dir_tp, sizeof dir_tp, "%s/tp_model", tmp);
  snprintf(dir_one, sizeof dir_one, "%s/one_model_rank%d", tmp, g_rank);
  EXPECT_OK(sg_model_save(tp, dir_tp));
  EXPECT_OK(sg_model_save(one, dir_one));
  sg_model *saved_tp = NULL, *saved_one = NULL;
  EXPECT_OK(sg_model_load(dir_tp, "f64", &saved_tp));
  EXPECT_OK(sg_model_load(dir_one, "f64", &saved_one));
  if (saved_tp && saved_one)
    for (int64_t i = 0; i < sg_model_num_params(saved_one); ++i)
      CHECK(same_tensor_within(saved_one, saved_tp, i, 0, tol));
  sg_model_free(saved_tp);
  sg_model_free(saved_one);
}

/* A checkpoint of the TP trainer `tp` (`steps` steps in) resumes in one process (a new "demo" under one_options,
 * returned in *resumed and *one) with the TP run's next step, and that run's checkpoint at `steps` loads back into
 * `tp` with the same two next steps (losses within tol). Every step takes the batch ids / lengths. */
static inline void check_checkpoints_both_ways(sg_trainer* tp, const sg_trainer_options* one_options, const char* dir,
                                               int64_t steps, const int32_t* ids, int64_t n_ids,
                                               const int64_t* lengths, int64_t n_seqs, double tol,
                                               sg_model** resumed, sg_trainer** one) {
  sg_metrics mt = sg_metrics_init(), mo = sg_metrics_init();
  EXPECT_OK(sg_trainer_save_checkpoint(tp, dir, 5, 0));
  EXPECT_OK(sg_trainer_step(tp, ids, NULL, n_ids, lengths, n_seqs, &mt));
  *resumed = demo();
  *one = NULL;
  EXPECT_OK(sg_trainer_create(*resumed, one_options, one));
  if (!*one) return;
  int64_t step = -1, position = -1;
  EXPECT_OK(sg_trainer_resume(*one, dir, &step, &position));
  CHECK(step == steps && position == 5);
  EXPECT_OK(sg_trainer_step(*one, ids, NULL, n_ids, lengths, n_seqs, &mo));
  printf("rank %d: after the checkpoint: tp %.17g, resumed in one process %.17g\n", g_rank, mt.loss, mo.loss);
  CHECK(close_within(mo.loss, mt.loss, mt.loss, tol));
  EXPECT_OK(sg_trainer_step(*one, ids, NULL, n_ids, lengths, n_seqs, &mo));
  char latest[600];
  snprintf(latest, sizeof latest, "%s/checkpoint-%lld", dir, (long long)steps);
  EXPECT_OK(sg_trainer_load_checkpoint(tp, latest, &step, NULL));
  EXPECT_OK(sg_trainer_step(tp, ids, NULL, n_ids, lengths, n_seqs, &mt));
  EXPECT_OK(sg_trainer_step(tp, ids, NULL, n_ids, lengths, n_seqs, &mt));
  CHECK(close_within(mo.loss, mt.loss, mt.loss, tol));
}

/* The program's exit status, after a line saying how this rank did. */
static inline int finish(void) {
  if (g_failures) fprintf(stderr, "rank %d: %d failures\n", g_rank, g_failures);
  else printf("rank %d: PASS\n", g_rank);
  return g_failures ? 1 : 0;
}

#endif  /* SEQGRAD_BINDINGS_C_TP_TEST_HARNESS_H_ */
