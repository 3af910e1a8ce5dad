/* What the C API's tensor-parallel tests share (seqgrad_tp_test.c, seqgrad_tp_dp_test.c): checks that count
 * failures on this rank, the "demo" preset in fp64, and the comparison of one parameter between two models. */
#ifndef SEQGRAD_BINDINGS_C_TP_TEST_HARNESS_H_
#define SEQGRAD_BINDINGS_C_TP_TEST_HARNESS_H_

#include <math.h>
#include <stdio.h>
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

static int close_rel(double a, double b, double scale) { return fabs(a - b) <= 1e-12 * (scale > 0 ? scale : 1); }

static sg_model* demo(void) {
  sg_model* m = NULL;
  EXPECT_OK(sg_model_create_preset("demo", "f64", 7, &m));
  return m;
}

/* Whether parameter i's values (grad = 0) or gradients agree in both models: ||x - y|| <= 1e-12 ||x|| (the
 * distributed tests' measure: an AdamW step divides by sqrt(v), which magnifies rounding in near-zero entries). */
static int same_tensor(sg_model* a, sg_model* b, int64_t i, int grad) {
  sg_param_info pa = sg_param_info_init(), pb = sg_param_info_init();
  EXPECT_OK(sg_model_param_info(a, i, &pa));
  EXPECT_OK(sg_model_param_info(b, i, &pb));
  if (strcmp(pa.name, pb.name) != 0 || pa.numel != pb.numel) return 0;
  const double* x = (const double*)(grad ? pa.grad : pa.data);
  const double* y = (const double*)(grad ? pb.grad : pb.data);
  if (!x || !y) return x == y;
  double norm = 0, diff = 0;
  for (int64_t k = 0; k < pa.numel; ++k) {
    norm += x[k] * x[k];
    diff += (x[k] - y[k]) * (x[k] - y[k]);
  }
  if (sqrt(diff) <= 1e-12 * sqrt(norm)) return 1;
  fprintf(stderr, "rank %d: %s%s differs: relative %.3g\n", g_rank, pa.name, grad ? ".grad" : "",
          sqrt(diff / norm));
  return 0;
}

#endif  /* SEQGRAD_BINDINGS_C_TP_TEST_HARNESS_H_ */
