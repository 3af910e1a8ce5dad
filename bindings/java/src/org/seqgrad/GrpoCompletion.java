package org.seqgrad;

/**
 * One GRPO completion for {@link Trainer#stepGrpo}: prompt + completion ids, labels (Hugging Face's convention, see
 * {@link Trainer}: -100 except on the completion, where labels[t] = ids[t]; null = next-token labels), its advantage,
 * and optionally per position the log-prob of the label under the policy that sampled it (oldLogprobs) and under the
 * reference policy (refLogprobs). The log-probs are aligned with ids and labels like the labels (since 0.7): entry t
 * is log p(labels[t] | ids[0..t)), finite wherever labels[t] is a label (t &gt;= 1), anything (e.g. NaN) at t = 0 and
 * where the label is -100: what {@link Trainer#score} returns (score with a trainer over the sampling
 * policy, or over the reference model). oldLogprobs null: the current policy (ratio 1); refLogprobs null: computed by
 * the trainer's reference model (needed unless grpoKlBeta = 0).
 */
public final class GrpoCompletion {
  /** Prompt + completion token ids. */
  public final int[] ids;
  /** Labels aligned with ids, or null. */
  public final int[] labels;
  /** The completion's advantage. */
  public final double advantage;
  /** Per position: log-prob of the label under the sampling policy (aligned with labels), or null. */
  public final double[] oldLogprobs;
  /** Per position: log-prob of the label under the reference policy (aligned with labels), or null. */
  public final double[] refLogprobs;

  /**
   * A completion with its log-probs.
   *
   * @param ids prompt + completion
   * @param labels aligned with ids, or null
   * @param advantage its advantage
   * @param oldLogprobs per position under the sampling policy, or null
   * @param refLogprobs per position under the reference policy, or null
   */
  public GrpoCompletion(int[] ids, int[] labels, double advantage, double[] oldLogprobs, double[] refLogprobs) {
    this.ids = ids;
    this.labels = labels;
    this.advantage = advantage;
    this.oldLogprobs = oldLogprobs;
    this.refLogprobs = refLogprobs;
  }

  /**
   * A completion of the current policy (ratio 1), reference log-probs from the trainer's reference model.
   *
   * @param ids prompt + completion
   * @param labels aligned with ids, or null
   * @param advantage its advantage
   */
  public GrpoCompletion(int[] ids, int[] labels, double advantage) {
    this(ids, labels, advantage, null, null);
  }
}
