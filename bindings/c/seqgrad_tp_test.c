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

static sg_trainer_options options(int64_t tp) {
  sg_trainer_options o = sg_trainer_default_options();
  o.strategy = "seco";
  o.chunk = 16;
  o.page_size = 8;
  o.lr = 1e-2;
  o.tp = tp;
  return o;
}

static sg_metrics old_size;  /* struct_size 4: neither a published size nor this library's */

int main(void) {
  old_size.struct_size = 4;
  const char* rank_env = getenv("OMPI_COMM_WORLD_RANK");
  const char* tmp = getenv("TEST_TMPDIR");
  g_rank = rank_env ? atoi(rank_env) : 0;
  if (!tmp) tmp = "/tmp";
  for (int i = 0; i < 2 * SEQ; ++i) g_ids[i] = (int32_t)((i * 37 + 11) % 128);

  /* One process: every rank on its own. */
  sg_model* single = demo();
  sg_trainer_options o1 = options(1);
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
  sg_trainer_options o2 = options(2);
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

  /* Saves: collective, rank 0 writes the whole model, the same tensors as one process's. */
  char dir_tp[512], dir_one[512], dir_ckpt[512];
  snprintf(dir_tp, sizeof dir_tp, "%s/tp_model", tmp);
  snprintf(dir_one, sizeof dir_one, "%s/one_model_rank%d", tmp, g_rank);
  snprintf(dir_ckpt, sizeof dir_ckpt, "%s/tp_checkpoints", tmp);
  EXPECT_OK(sg_model_save(split, dir_tp));
  EXPECT_OK(sg_model_save(single, dir_one));
  sg_model *saved_tp = NULL, *saved_one = NULL;
  EXPECT_OK(sg_model_load(dir_tp, "f64", &saved_tp));
  EXPECT_OK(sg_model_load(dir_one, "f64", &saved_one));
  if (saved_tp && saved_one)
    for (int64_t i = 0; i < sg_model_num_params(saved_one); ++i) CHECK(same_tensor(saved_one, saved_tp, i, 0));
  sg_model_free(saved_tp);
  sg_model_free(saved_one);

  /* A TP checkpoint resumes in one process with the next step of the TP run. */
  EXPECT_OK(sg_trainer_save_checkpoint(t2, dir_ckpt, 5, 0));
  EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
  sg_model* resumed = demo();
  sg_trainer* t3 = NULL;
  EXPECT_OK(sg_trainer_create(resumed, &o1, &t3));
  int64_t step = -1, position = -1;
  EXPECT_OK(sg_trainer_resume(t3, dir_ckpt, &step, &position));
  CHECK(step == STEPS && position == 5);
  sg_metrics m3 = sg_metrics_init();
  EXPECT_OK(sg_trainer_step(t3, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m3));
  printf("rank %d: after the checkpoint: tp=2 %.17g, resumed in one process %.17g\n", g_rank, m2.loss, m3.loss);
  CHECK(close_rel(m3.loss, m2.loss, m2.loss));
  /* ... and a one-process checkpoint under tp = 2. */
  EXPECT_OK(sg_trainer_step(t3, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m3));
  char latest[600];
  snprintf(latest, sizeof latest, "%s/checkpoint-%d", dir_ckpt, STEPS);
  EXPECT_OK(sg_trainer_load_checkpoint(t2, latest, &step, NULL));
  EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
  EXPECT_OK(sg_trainer_step(t2, g_ids, NULL, 2 * SEQ, g_lengths, 2, &m2));
  CHECK(close_rel(m3.loss, m2.loss, m2.loss));

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
  sg_trainer_options o = options(3);
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), SG_ERR_INVALID_ARGUMENT,
                "options->tp = 3: the job has 2 ranks, which is not tp (3)");
  o = options(-1);
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), SG_ERR_INVALID_ARGUMENT, "options->tp is -1");
  o = options(g_rank == 0 ? 2 : 4);
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
  o = options(2);
  if (g_rank == 0) o.chunk = -5;
  EXPECT_STATUS(sg_trainer_create(second, &o, &bad), g_rank == 0 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_ABORTED,
                g_rank == 0 ? "options->chunk" : "rank 0 of 2 failed");
  CHECK(bad == NULL);
  /* A 0.6 caller's options (no tp field): one process. */
  o = options(2);
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
  if (g_failures) fprintf(stderr, "rank %d: %d failures\n", g_rank, g_failures);
  else printf("rank %d: PASS\n", g_rank);
  return g_failures ? 1 : 0;
}
