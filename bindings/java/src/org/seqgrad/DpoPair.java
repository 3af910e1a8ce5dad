package org.seqgrad;

/**
 * A DPO preference pair for {@link Trainer#stepDpo}: two sequences (prompt + response) whose labels are -100 except on
 * the response (labels[t] = the token after position t; null = next-token labels over the whole sequence), and the
 * reference model's log-probs summed over each sequence's labelled tokens (NaN = computed by the trainer's reference
 * model).
 */
public final class DpoPair {
  public final int[] chosenIds;
  public final int[] chosenLabels;
  public final int[] rejectedIds;
  public final int[] rejectedLabels;
  public final double refChosenLogp;
  public final double refRejectedLogp;

  public DpoPair(int[] chosenIds, int[] chosenLabels, int[] rejectedIds, int[] rejectedLabels, double refChosenLogp,
      double refRejectedLogp) {
    this.chosenIds = chosenIds;
    this.chosenLabels = chosenLabels;
    this.rejectedIds = rejectedIds;
    this.rejectedLabels = rejectedLabels;
    this.refChosenLogp = refChosenLogp;
    this.refRejectedLogp = refRejectedLogp;
  }

  /** A pair whose reference log-probs come from the trainer's reference model. */
  public DpoPair(int[] chosenIds, int[] chosenLabels, int[] rejectedIds, int[] rejectedLabels) {
    this(chosenIds, chosenLabels, rejectedIds, rejectedLabels, Double.NaN, Double.NaN);
  }
}
