/* Tensor parallelism through the C API, run on each rank of mpirun -np 2: a tp = 2 trainer on "demo" (fp64) gives
 * the losses, weights and gradients of one process within 1e-12 relative, its save and checkpoint are one
 * process's, its metrics report this rank's memory and the bytes it reduced, and bad tp values are refused on every
 * rank with the numbers. Every rank also runs the one-process reference itself (no communication). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bindings/c/tp_test_harness.h"
#include "seqgrad/seqgrad.h"

#define SEQ 40
#define STEPS 3
static int32_t g_ids[2 * SEQ];
static const int64_t g_lengths[2] = {SEQ, SEQ};


static sg_metrics old_size;  /* struct_size 4: neither a published size nor this library's */

int main(void) {
  old_size.struct_size = 4;
  const char* tmp = start_rank(g_ids, 2 * SEQ);

  /* One process: every rank on its own. */
  sg_model* single = demo();
  sg_trainer_options o1 = seco_options(1);
  sg_trainer* t1 = NULL;
  EXPECT_OK(sg_trainer_create(single, &o1, &t1));
  double losses1[STEPS + 1];
  sg_metrics m1 = sg_metrics_init();
  for (int s = 0; s < STEPS; ++s) {
    EXPECT_OK(sg_trainer_step(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m1));
    losses1[s] = m1.loss;
  }
  CHECK(m1.tp == 1 && m1.tp_bytes_reduced == 0);
  EXPECT_OK(sg_trainer_compute_gradients(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m1));
  losses1[STEPS] = m1.loss;

  /* Tensor parallel over the 2 ranks. */
  sg_model* split = demo();
  sg_trainer_options o2 = seco_options(2);
  sg_trainer* t2 = NULL;
  EXPECT_OK(sg_trainer_create(split, &o2, &t2));
  if (!t2) return 1;
  sg_metrics m2 = sg_metrics_init();
  for (int s = 0; s < STEPS; ++s) {
    EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
    printf("rank %d step %d: one process %.17g, tp=2 %.17g\n", g_rank, s + 1, losses1[s], m2.loss);
    CHECK(close_rel(m2.loss, losses1[s], fabs(losses1[s])));
  }
  EXPECT_OK(sg_trainer_compute_gradients(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
  CHECK(close_rel(m2.loss, losses1[STEPS], fabs(losses1[STEPS])));
  /* This rank's memory: half the heads, SwiGLU rows and vocabulary; norms stay whole. */
  printf("rank %d: weights %lld bytes (one process %lld), kv_cache %lld (%lld), %lld bytes reduced\n", g_rank,
         (long long)m2.peak_bytes_by_category[0], (long long)m1.peak_bytes_by_category[0],
         (long long)m2.peak_bytes_by_category[4], (long long)m1.peak_bytes_by_category[4],
         (long long)m2.tp_bytes_reduced);
  CHECK(m2.tp == 2 && m2.tp_bytes_reduced > 0);
  CHECK(m2.peak_bytes_by_category[0] < 0.55 * m1.peak_bytes_by_category[0]);
  CHECK(m2.peak_bytes_by_category[4] * 2 == m1.peak_bytes_by_category[4]);

  /* The handle shows the whole model: weights after 3 steps and the gradients of the 4th batch. */
  CHECK(sg_model_num_params(split) == sg_model_num_params(single));
  for (int64_t i = 0; i < sg_model_num_params(single); ++i) {
    CHECK(same_tensor(single, split, i, 0));
    CHECK(same_tensor(single, split, i, 1));
  }
  /* A value written through the handle is what the next call trains. */
  sg_param_info info = sg_param_info_init();
  EXPECT_OK(sg_model_param_info(single, 1, &info));
  ((double*)info.data)[0] += 0.25;
  EXPECT_OK(sg_model_param_info(split, 1, &info));
  ((double*)info.data)[0] += 0.25;
  EXPECT_OK(sg_trainer_evaluate(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m1));
  EXPECT_OK(sg_trainer_evaluate(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
  CHECK(close_rel(m2.loss, m1.loss, m1.loss));

  /* Scores and detailed evaluation through the distributed cross-entropy. */
  double lp1[2 * SEQ], lp2[2 * SEQ];
  EXPECT_OK(sg_trainer_score(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, lp1, NULL));
  EXPECT_OK(sg_trainer_score(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, lp2, NULL));
  for (int i = 0; i < 2 * SEQ; ++i) CHECK(isnan(lp1[i]) ? isnan(lp2[i]) : close_rel(lp1[i], lp2[i], fabs(lp1[i])));
  sg_eval_result e1 = sg_eval_result_init(), e2 = sg_eval_result_init();
  EXPECT_OK(sg_trainer_evaluate_detailed(t1, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, &e1));
  EXPECT_OK(sg_trainer_evaluate_detailed(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, NULL, &e2));
  CHECK(close_rel(e1.loss, e2.loss, e1.loss) && e1.correct == e2.correct && e1.tokens == e2.tokens);

  /* LoRA with dropout on every linear layer: the adapters' gradients and steps are one process's too. */
  {
    sg_lora_options lo = sg_lora_default_options();
    lo.rank = 4;
    lo.dropout = 0.2;
    lo.targets = "all";
    sg_model *la = demo(), *lb = demo();
    EXPECT_OK(sg_model_enable_lora(la, &lo));
    EXPECT_OK(sg_model_enable_lora(lb, &lo));
    sg_trainer *ta = NULL, *tb = NULL;
    EXPECT_OK(sg_trainer_create(la, &o1, &ta));
    EXPECT_OK(sg_trainer_create(lb, &o2, &tb));
    sg_metrics ma = sg_metrics_init(), mb = sg_metrics_init();
    for (int s = 0; s < 2; ++s) {
      EXPECT_OK(sg_trainer_step(ta, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ma));
      EXPECT_OK(sg_trainer_step(tb, g_ids, NULL, 2 * SEQ, g_lengths, 2, &mb));
      CHECK(close_rel(ma.loss, mb.loss, ma.loss));
    }
    EXPECT_OK(sg_trainer_compute_gradients(ta, g_ids, NULL, 2 * SEQ, g_lengths, 2, &ma));
    EXPECT_OK(sg_trainer_compute_gradients(tb, g_ids, NULL, 2 * SEQ, g_lengths, 2, &mb));
    for (int64_t i = 0; i < sg_model_num_params(la); ++i) {
      CHECK(same_tensor(la, lb, i, 0));
      CHECK(same_tensor(la, lb, i, 1));
    }
    sg_trainer_free(ta);
    sg_trainer_free(tb);
    sg_model_free(la);
    sg_model_free(lb);
  }

  /* Saves: collective, rank 0 writes the whole model, the same tensors as one process's. A TP checkpoint resumes in
   * one process with the next step of the TP run, and a one-process checkpoint under tp = 2. */
  check_same_saves(single, split, tmp, 1e-12);
  char dir_ckpt[512];
  snprintf(dir_ckpt, sizeof dir_ckpt, "%s/tp_checkpoints", tmp);
  sg_model* resumed = NULL;
  sg_trainer* t3 = NULL;
  check_checkpoints_both_ways(t2, &o1, dir_ckpt, STEPS, g_ids, 2 * SEQ, g_lengths, 2, 1e-12, &resumed, &t3);

  /* A bad argument on one rank fails the call on every rank at once (no rank waits in a collective), and the next
   * call trains on. */
  {
    const int64_t bad_lengths[2] = {SEQ, SEQ + 1};
    const int64_t* lengths = g_rank == 1 ? bad_lengths : g_lengths;
    EXPECT_STATUS(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, lengths, 2, &m2),
                  g_rank == 1 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_ABORTED,
                  g_rank == 1 ? "'lengths' sums to more than" : "rank 1 of 2 failed");
    EXPECT_STATUS(sg_trainer_save_checkpoint(t2, dir_ckpt, 0, g_rank == 1 ? -1 : 0),
                  g_rank == 1 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_ABORTED, g_rank == 1 ? "'keep'" : "rank 1 of 2");
    EXPECT_STATUS(sg_trainer_optimizer_step(t2, g_rank == 1 ? &old_size : NULL),
                  g_rank == 1 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_ABORTED, g_rank == 1 ? "struct_size" : "rank 1 of 2");
    const int64_t before = sg_trainer_step_count(t2);
    EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
    CHECK(sg_trainer_step_count(t2) == before + 1 && m2.tp == 2);
  }

  /* Bad input: refused on every rank with the numbers. */
  sg_trainer* bad = NULL;
  sg_model* second = demo();
  EXPECT_STATUS(sg_trainer_create(split, &o2, &bad), SG_ERR_FAILED_PRECONDITION, "already has a tensor-parallel");
  sg_trainer_options o = seco_options(3);
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), SG_ERR_INVALID_ARGUMENT,
                "options->tp = 3: the job has 2 ranks, which is not tp (3)");
  o = seco_options(-1);
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), SG_ERR_INVALID_ARGUMENT, "options->tp is -1");
  o = seco_options(g_rank == 0 ? 2 : 4);
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), SG_ERR_FAILED_PRECONDITION,
                "options->tp differs across ranks (rank 0: 2, rank 1: 4)");
  sg_model* tiny = NULL;
  EXPECT_OK(sg_model_create_preset("tiny", "f64", 7, &tiny));
  EXPECT_STATUS(sg_trainer_create(tiny, &o2, &bad), SG_ERR_INVALID_ARGUMENT,
                "options->tp = 2: vocab_size=97 is not divisible by 2 (1 left over)");
  /* A rank whose own model differs: the other rank hears of it instead of waiting. */
  EXPECT_STATUS(sg_trainer_create(g_rank == 1 ? tiny : second, &o2, &bad), g_rank == 1 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_ABORTED,
                g_rank == 1 ? "vocab_size=97" : "rank 1 of 2 failed");
  /* A rank whose other options are bad: refused there, the other rank hears of it. */
  o = seco_options(2);
  if (g_rank == 0) o.chunk = -5;
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), g_rank == 0 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_ABORTED,
                g_rank == 0 ? "options->chunk" : "rank 0 of 2 failed");
  CHECK(bad == NULL);
  /* A 0.6 caller's options (no tp field): one process. */
  o = seco_options(2);
  o.struct_size = offsetof(sg_trainer_options, tp);
  EXPECT_OK(sg_trainer_create(second, &o, &bad));
  sg_metrics old = sg_metrics_init();
  old.struct_size = offsetof(sg_metrics, tp);
  EXPECT_OK(sg_trainer_step(bad, g_ids, NULL, 2 * SEQ, g_lengths, 2, &old));
  CHECK(close_rel(old.loss, losses1[0], losses1[0]));

  sg_trainer_free(bad);
  sg_trainer_free(t1);
  sg_trainer_free(t2);
  sg_trainer_free(t3);
  sg_model_free(single);
  sg_model_free(split);
  sg_model_free(resumed);
  sg_model_free(second);
  sg_model_free(tiny);
  return finish();
}
