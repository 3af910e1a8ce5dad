package org.seqgrad;

/**
 * One GRPO completion for {@link Trainer#stepGrpo}: prompt + completion ids, labels (-100 except on the completion;
 * null = next-token labels), its advantage, and optionally per position the log-prob of the label under the policy
 * that sampled it (oldLogprobs) and under the reference policy (refLogprobs): one entry per id, aligned with labels,
 * finite where the label is valid (NaN allowed where it is -100). oldLogprobs null: the current policy (ratio 1);
 * refLogprobs null: computed by the trainer's reference model (needed unless grpoKlBeta = 0).
 */
public final class GrpoCompletion {
  public final int[] ids;
  public final int[] labels;
  public final double advantage;
  public final double[] oldLogprobs;
  public final double[] refLogprobs;

  public GrpoCompletion(int[] ids, int[] labels, double advantage, double[] oldLogprobs, double[] refLogprobs) {
    this.ids = ids;
    this.labels = labels;
    this.advantage = advantage;
    this.oldLogprobs = oldLogprobs;
    this.refLogprobs = refLogprobs;
  }

  public GrpoCompletion(int[] ids, int[] labels, double advantage) {
    this(ids, labels, advantage, null, null);
  }
}
