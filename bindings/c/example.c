/* A minimal C program training the "tiny" preset through libseqgrad.so (C99, public header only).
 * usage: example [steps [strategy]]   (strategy: seco by default; spaco backpropagates 2 of the 4 chunks) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seqgrad/seqgrad.h"

static int fail(sg_status* st) {
  fprintf(stderr, "error %s: %s\n", sg_code_name(sg_status_code(st)), sg_status_message(st));
  sg_status_free(st);
  return 1;
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? atoi(argv[1]) : 5;
  enum { kLen = 64 };
  int32_t ids[kLen];
  int64_t lengths[1] = {kLen};
  sg_model* model = NULL;
  sg_trainer* trainer = NULL;
  sg_trainer_options opts = sg_trainer_default_options();
  sg_metrics m = sg_metrics_init();
  sg_status* st;
  int i, c;

  printf("seqgrad %s\n", sg_version());
  for (i = 0; i < kLen; ++i) ids[i] = (int32_t)((i * 5) % 40 + 3);
  if ((st = sg_model_create_preset("tiny", "f32", 7, &model))) return fail(st);
  opts.strategy = argc > 2 ? argv[2] : "seco";
  opts.chunk = 16;
  if (strcmp(opts.strategy, "spaco") == 0) opts.spaco_budget = 2; /* of the 64 / 16 = 4 chunks, on average */
  opts.page_size = 16;
  opts.lr = 3e-3;
  if ((st = sg_trainer_create(model, &opts, &trainer))) return fail(st);
  for (i = 1; i <= steps; ++i) {
    if ((st = sg_trainer_step(trainer, ids, NULL, kLen, lengths, 1, &m))) return fail(st);
    printf("step %d loss %.4f tokens %lld grad_norm %.4f chunks %lld/%lld peak %lld bytes\n", i, m.loss,
           (long long)m.tokens, m.grad_norm, (long long)m.chunks_backpropagated, (long long)m.chunks,
           (long long)m.peak_bytes);
  }
  for (c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c)
    printf("  %-12s %lld\n", sg_memory_category_name(c), (long long)m.bytes_at_peak_by_category[c]);
  sg_trainer_free(trainer);
  sg_model_free(model);
  return 0;
}
