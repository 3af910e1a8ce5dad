/* A minimal C program training the "tiny" preset through libseqgrad.so (C99, public header only): a 16-token prompt
 * without loss and a 48-token response, then the response's per-token log-probs.
 * usage: example [steps [strategy]]   (strategy: seco by default; spaco backpropagates 2 of the 4 chunks)
 * On a machine shared with other processes, run it with OMP_WAIT_POLICY=PASSIVE in the environment. */
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
  enum { kLen = 64, kPrompt = 16 };
  int32_t ids[kLen], labels[kLen];
  double logprobs[kLen], sum = 0;
  int64_t lengths[1] = {kLen};
  sg_model* model = NULL;
  sg_trainer* trainer = NULL;
  sg_trainer_options opts = sg_trainer_default_options();
  sg_metrics m = sg_metrics_init();
  sg_status* st;
  int i, c;

  printf("seqgrad %s\n", sg_version());
  for (i = 0; i < kLen; ++i) ids[i] = (int32_t)((i * 5) % 40 + 3);
  /* Hugging Face's labels: aligned with ids (the library shifts them), -100 = no loss. */
  for (i = 0; i < kLen; ++i) labels[i] = i < kPrompt ? -100 : ids[i];
  if ((st = sg_model_create_preset("tiny", "f32", 7, &model))) return fail(st);
  opts.strategy = argc > 2 ? argv[2] : "seco";
  opts.chunk = 16;
  if (strcmp(opts.strategy, "spaco") == 0) opts.spaco_budget = 2; /* of the 64 / 16 = 4 chunks, on average */
  opts.page_size = 16;
  opts.lr = 3e-3;
  if ((st = sg_trainer_create(model, &opts, &trainer))) return fail(st);
  for (i = 1; i <= steps; ++i) {
    if ((st = sg_trainer_step(trainer, ids, labels, kLen, lengths, 1, &m))) return fail(st);
    printf("step %d loss %.4f tokens %lld grad_norm %.4f chunks %lld/%lld peak %lld bytes\n", i, m.loss,
           (long long)m.tokens, m.grad_norm, (long long)m.chunks_backpropagated, (long long)m.chunks,
           (long long)m.peak_bytes);
  }
  for (c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c)
    printf("  %-12s %lld\n", sg_memory_category_name(c), (long long)m.bytes_at_peak_by_category[c]);
  /* logprobs[t] = log p(labels[t] | ids[0..t)), NaN where nothing is predicted (the prompt, position 0). */
  if ((st = sg_trainer_score(trainer, ids, labels, kLen, lengths, 1, logprobs, NULL))) return fail(st);
  for (i = kPrompt; i < kLen; ++i) sum += logprobs[i];
  printf("response log-prob %.4f over %d tokens\n", sum, kLen - kPrompt);
  sg_trainer_free(trainer);
  sg_model_free(model);
  return 0;
}
