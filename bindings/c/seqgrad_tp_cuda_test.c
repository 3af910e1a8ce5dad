/* Tensor parallelism through the C API on a "cuda" model, run on each rank of mpirun -np 2 (or -np 4: 2 groups x 2,
 * each group computing half of the batch every rank passes) against the CPU emulation of the CUDA backend (whose
 * device memory faults on any host access): options.tp = 2 splits the device model over each group's ranks. On
 * "demo" (fp64) the losses, gradient norms, weights and gradients (read through sg_model_read_param) equal one CPU
 * process's within 1e-10 relative, a save is one process's model, and a checkpoint written by the TP run resumes in
 * one CPU process and back on the device with the same next steps. Every rank also runs the one-process reference
 * itself (no communication). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bindings/c/tp_test_harness.h"
#include "seqgrad/seqgrad.h"

#define SEQ 24
#define STEPS 3
#define TOL 1e-10 /* the emulated kernels sum in another order than the CPU ones */
static int32_t g_ids[2 * SEQ];
static const int64_t g_lengths[2] = {SEQ, SEQ};


static sg_trainer_options options(int64_t tp) {
  sg_trainer_options o = seco_options(tp);
  o.clip_grad_norm = 0.5; /* the global norm over split and replicated gradients */
  return o;
}

/* The harness's demo() on "cuda". */
static sg_model* demo_on_cuda(void) {
  sg_model_options mo = sg_model_default_options();
  mo.dtype = "f64";
  mo.device = "cuda";
  mo.seed = 7;
  sg_model* m = NULL;
  EXPECT_OK(sg_model_create_preset_with("demo", &mo, &m));
  return m;
}

static void compare_models(sg_model* one, sg_model* tp, int grads) {
  for (int64_t i = 0; i < sg_model_num_params(one); ++i) {
    CHECK(same_tensor_within(one, tp, i, 0, TOL));
    if (grads) CHECK(same_tensor_within(one, tp, i, 1, TOL));
  }
}

int main(void) {
  const char* tmp = start_rank(g_ids, 2 * SEQ);

  sg_model* single = demo();
  sg_model* device = demo_on_cuda();
  if (!single || !device) return 1;
  CHECK(strcmp(sg_model_device(device), "cuda") == 0);
  sg_param_info info = sg_param_info_init();
  EXPECT_OK(sg_model_param_info(device, 0, &info));
  CHECK(info.on_device != 0);
  sg_trainer_options o1 = options(1), o2 = options(2);
  sg_trainer *t1 = NULL, *t2 = NULL;
  EXPECT_OK(sg_trainer_create(single, &o1, &t1));
  EXPECT_OK(sg_trainer_create(device, &o2, &t2));
  if (!t1 || !t2) return 1;

  sg_metrics m1 = sg_metrics_init(), m2 = sg_metrics_init();
  for (int s = 0; s < STEPS; ++s) {
    EXPECT_OK(sg_trainer_step(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m1));
    EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
    printf("rank %d step %d: one CPU process %.17g, tp=2 on cuda %.17g (grad norm %.17g vs %.17g)\n", g_rank, s + 1,
           m1.loss, m2.loss, m1.grad_norm, m2.grad_norm);
    CHECK(close_within(m2.loss, m1.loss, fabs(m1.loss), TOL));
    CHECK(close_within(m2.grad_norm, m1.grad_norm, m1.grad_norm, TOL));
    CHECK(m2.tp == 2 && m2.tp_bytes_reduced > 0);
  }
  compare_models(single, device, 1); /* the weights after the steps, and the last step's gradients */
  EXPECT_OK(sg_trainer_compute_gradients(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m1));
  EXPECT_OK(sg_trainer_compute_gradients(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
  CHECK(close_within(m2.loss, m1.loss, fabs(m1.loss), TOL));
  compare_models(single, device, 1);

  /* A save is collective, rank 0 writes the whole model gathered from the device blocks: one process's model. A
   * checkpoint of the device TP run resumes in one CPU process with the TP run's next step, and loads back onto the
   * device blocks (optimizer moments included): the same next steps, weights and gradients. */
  check_same_saves(single, device, tmp, TOL);
  char dir_ckpt[512];
  snprintf(dir_ckpt, sizeof dir_ckpt, "%s/tp_cuda_checkpoints", tmp);
  sg_model* resumed = NULL;
  sg_trainer* t3 = NULL;
  check_checkpoints_both_ways(t2, &o1, dir_ckpt, STEPS, g_ids, 2 * SEQ, g_lengths, 2, TOL, &resumed, &t3);
  if (resumed) compare_models(resumed, device, 1);

  sg_trainer_free(t1);
  sg_trainer_free(t2);
  sg_trainer_free(t3);
  sg_model_free(single);
  sg_model_free(device);
  sg_model_free(resumed);
  return finish();
}
