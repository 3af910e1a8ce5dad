/* Tensor × data parallelism through the C API, run on each rank of mpirun -np 4: options.tp = 2 makes a grid of 2
 * tensor-parallel groups × 2 data-parallel ranks (world rank w is tensor rank w % 2 of group w / 2), every rank
 * passing the whole batch; each group computes its half of it. On "demo" (fp64) the losses, weights and gradients
 * equal one process's on the whole batch within 1e-12 relative (also for one record, which only group 1
 * computes), a save is one process's (written once), and accumulating micro-batches across groups is refused on
 * every rank. Every rank also runs the one-process reference itself (no communication). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bindings/c/tp_test_harness.h"
#include "seqgrad/seqgrad.h"

#define SEQ 24
#define NSEQ 4
#define STEPS 3
static int32_t g_ids[NSEQ * SEQ];
static const int64_t g_lengths[NSEQ] = {SEQ, SEQ, SEQ, SEQ};

static sg_trainer_options options(int64_t tp) {
  sg_trainer_options o = seco_options(tp);
  o.clip_grad_norm = 0.5; /* the global norm over split and whole gradients, after the groups' sum */
  return o;
}

int main(void) {
  const char* tmp = start_rank(g_ids, NSEQ * SEQ);

  sg_model* single = demo();
  sg_trainer_options o1 = options(1);
  sg_trainer* t1 = NULL;
  EXPECT_OK(sg_trainer_create(single, &o1, &t1));
  sg_model* grid = demo();
  sg_trainer_options o2 = options(2);
  sg_trainer* t2 = NULL;
  EXPECT_OK(sg_trainer_create(grid, &o2, &t2));
  if (!t1 || !t2) return 1;
  sg_metrics m1 = sg_metrics_init(), m2 = sg_metrics_init();
  for (int s = 0; s < STEPS; ++s) {
    EXPECT_OK(sg_trainer_step(t1, g_ids, NULL, NSEQ * SEQ, g_lengths, NSEQ, &m1));
    EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, NSEQ * SEQ, g_lengths, NSEQ, &m2));
    printf("rank %d step %d: one process %.17g, tp=2 x dp=2 %.17g (grad norm %.17g vs %.17g)\n", g_rank, s + 1,
           m1.loss, m2.loss, m1.grad_norm, m2.grad_norm);
    CHECK(close_rel(m2.loss, m1.loss, fabs(m1.loss)));
    CHECK(close_rel(m2.grad_norm, m1.grad_norm, m1.grad_norm));
    CHECK(m2.tokens == m1.tokens);
  }
  EXPECT_OK(sg_trainer_compute_gradients(t1, g_ids, NULL, NSEQ * SEQ, g_lengths, NSEQ, &m1));
  EXPECT_OK(sg_trainer_compute_gradients(t2, g_ids, NULL, NSEQ * SEQ, g_lengths, NSEQ, &m2));
  CHECK(close_rel(m2.loss, m1.loss, fabs(m1.loss)));
  CHECK(m2.tp == 2 && m2.tp_bytes_reduced > 0);
  for (int64_t i = 0; i < sg_model_num_params(single); ++i) {
    CHECK(same_tensor(single, grid, i, 0));
    CHECK(same_tensor(single, grid, i, 1));
  }

  /* One record: group 0 (world ranks 0, 1) gets an empty share and communicates nothing in its forward and
   * backward, group 1 computes it all; the gradients are still one process's. */
  EXPECT_OK(sg_trainer_compute_gradients(t1, g_ids, NULL, SEQ, g_lengths, 1, &m1));
  EXPECT_OK(sg_trainer_compute_gradients(t2, g_ids, NULL, SEQ, g_lengths, 1, &m2));
  printf("rank %d: one record, %lld bytes reduced in the group\n", g_rank, (long long)m2.tp_bytes_reduced);
  CHECK(g_rank < 2 ? m2.tp_bytes_reduced == 0 : m2.tp_bytes_reduced > 0);
  CHECK(close_rel(m2.loss, m1.loss, fabs(m1.loss)));
  for (int64_t i = 0; i < sg_model_num_params(single); ++i) CHECK(same_tensor(single, grid, i, 1));

  /* A save is collective and written by the job's rank 0 alone: one process's model. */
  check_same_saves(single, grid, tmp, 1e-12);

  /* Micro-batches are not split across groups: refused on every rank, then training goes on. */
  EXPECT_STATUS(sg_trainer_accumulate_gradients(t2, g_ids, NULL, NSEQ * SEQ, g_lengths, NSEQ, &m2),
                SG_ERR_UNIMPLEMENTED, "accumulating micro-batches across 2 tensor-parallel groups");
  EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, NSEQ * SEQ, g_lengths, NSEQ, &m2));
  /* A job of 4 ranks is not a multiple of 3. */
  sg_model* second = demo();
  sg_trainer* bad = NULL;
  sg_trainer_options o3 = options(3);
  EXPECT_STATUS(sg_trainer_create(second, &o3, &bad), SG_ERR_INVALID_ARGUMENT,
                "options->tp = 3: the job has 4 ranks, which is not tp (3)");

  sg_trainer_free(t1);
  sg_trainer_free(t2);
  sg_model_free(single);
  sg_model_free(grid);
  sg_model_free(second);
  return finish();
}
