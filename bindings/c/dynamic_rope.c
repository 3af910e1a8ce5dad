/* Prints, per sequence given, sg_trainer_compute_gradients' loss and every gradient of the model at MODEL_DIR in f64
 * (chunked: seco, chunk 7) as one JSON line {"loss": L, "grads": {"name": [...], ...}}; dynamic_rope_test.py compares
 * them with transformers. usage: dynamic_rope MODEL_DIR IDS... (each IDS comma-separated token ids) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seqgrad/seqgrad.h"

static void check(sg_status* s) {
  if (!s) return;
  fprintf(stderr, "%s\n", sg_status_message(s));
  exit(1);
}

static int64_t parse_ids(const char* text, int32_t* ids, int64_t cap) {
  int64_t n = 0;
  char* end = NULL;
  for (const char* p = text; *p && n < cap; p = *end ? end + 1 : end) ids[n++] = (int32_t)strtol(p, &end, 10);
  return n;
}

static void print_grads(sg_model* model) {
  printf("\"grads\": {");
  for (int64_t i = 0; i < sg_model_num_params(model); ++i) {
    sg_param_info info = sg_param_info_init();
    check(sg_model_param_info(model, i, &info));
    printf("%s\"%s\": [", i ? ", " : "", info.name);
    for (int64_t k = 0; k < info.numel; ++k) printf("%s%.17g", k ? ", " : "", ((const double*)info.grad)[k]);
    printf("]");
  }
  printf("}");
}

int main(int argc, char** argv) {
  sg_model* model = NULL;
  sg_trainer* trainer = NULL;
  sg_trainer_options options = sg_trainer_default_options();
  if (argc < 3) {
    fprintf(stderr, "usage: %s MODEL_DIR IDS...\n", argv[0]);
    return 2;
  }
  check(sg_model_load(argv[1], "f64", &model));
  options.strategy = "seco";
  options.chunk = 7;
  check(sg_trainer_create(model, &options, &trainer));
  for (int a = 2; a < argc; ++a) {
    int32_t ids[256];
    int64_t length = parse_ids(argv[a], ids, 256);
    sg_metrics metrics = sg_metrics_init();
    check(sg_trainer_compute_gradients(trainer, ids, NULL, length, &length, 1, &metrics));
    printf("{\"loss\": %.17g, ", metrics.loss);
    print_grads(model);
    printf("}\n");
  }
  sg_trainer_free(trainer);
  sg_model_free(model);
  return 0;
}
