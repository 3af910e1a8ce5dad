package org.seqgrad;

/**
 * A DPO preference pair for {@link Trainer#stepDpo}: two sequences (prompt + response) whose labels are -100 except on
 * the response, in Hugging Face's convention (aligned with the ids: labels[t] = ids[t] on the response tokens; the
 * library shifts them, see {@link Trainer}; null = next-token labels over the whole sequence), and the reference
 * model's log-probs summed over each sequence's labelled tokens (NaN = computed by the trainer's reference model;
 * {@link Trainer#score} of a trainer over the reference model gives them, summed).
 */
public final class DpoPair {
  /** Prompt + chosen response. */
  public final int[] chosenIds;
  /** Labels of chosenIds, or null. */
  public final int[] chosenLabels;
  /** Prompt + rejected response. */
  public final int[] rejectedIds;
  /** Labels of rejectedIds, or null. */
  public final int[] rejectedLabels;
  /** The reference model's summed log-prob of the chosen labels; NaN = computed. */
  public final double refChosenLogp;
  /** The reference model's summed log-prob of the rejected labels; NaN = computed. */
  public final double refRejectedLogp;

  /**
   * A pair with the reference model's log-probs given.
   *
   * @param chosenIds prompt + chosen response
   * @param chosenLabels their labels, or null
   * @param rejectedIds prompt + rejected response
   * @param rejectedLabels their labels, or null
   * @param refChosenLogp the reference's summed log-prob of the chosen labels (NaN = computed)
   * @param refRejectedLogp the same for the rejected labels
   */
  public DpoPair(int[] chosenIds, int[] chosenLabels, int[] rejectedIds, int[] rejectedLabels, double refChosenLogp,
      double refRejectedLogp) {
    this.chosenIds = chosenIds;
    this.chosenLabels = chosenLabels;
    this.rejectedIds = rejectedIds;
    this.rejectedLabels = rejectedLabels;
    this.refChosenLogp = refChosenLogp;
    this.refRejectedLogp = refRejectedLogp;
  }

  /**
   * A pair whose reference log-probs come from the trainer's reference model.
   *
   * @param chosenIds prompt + chosen response
   * @param chosenLabels their labels, or null
   * @param rejectedIds prompt + rejected response
   * @param rejectedLabels their labels, or null
   */
  public DpoPair(int[] chosenIds, int[] chosenLabels, int[] rejectedIds, int[] rejectedLabels) {
    this(chosenIds, chosenLabels, rejectedIds, rejectedLabels, Double.NaN, Double.NaN);
  }
}
