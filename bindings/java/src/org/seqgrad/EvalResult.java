package org.seqgrad;

/**
 * Held-out evaluation ({@link Trainer#evaluateDetailed}): loss, perplexity, next-token accuracy and, with distances,
 * the retrieval accuracy per distance bucket k = [2^k, 2^(k+1)) from bucket 0 up to the largest distance seen.
 */
public final class EvalResult {
  /** Sequences evaluated. */
  public final long sequences;
  /** Labelled positions. */
  public final long tokens;
  /** Mean token loss over them. */
  public final double loss;
  /** exp(loss). */
  public final double perplexity;
  /** Labelled positions whose arg max equals the label. */
  public final long correct;
  /** correct / tokens. */
  public final double accuracy;
  /** Peak engine memory of the call. */
  public final long peakBytes;
  /** Wall time of the call. */
  public final double seconds;
  /** Per distance bucket: labelled positions, of which correct, mean loss (empty without distances). */
  public final long[] bucketCount;
  /** Per distance bucket: labelled positions predicted correctly. */
  public final long[] bucketCorrect;
  /** Per distance bucket: mean loss. */
  public final double[] bucketLoss;

  EvalResult(double[] a) {
    sequences = (long) a[0];
    tokens = (long) a[1];
    loss = a[2];
    perplexity = a[3];
    correct = (long) a[4];
    accuracy = a[5];
    peakBytes = (long) a[6];
    seconds = a[7];
    int n = (int) a[8];
    bucketCount = new long[n];
    bucketCorrect = new long[n];
    bucketLoss = new double[n];
    for (int k = 0; k < n; ++k) {  // layout: seqgrad_jni.cc
      bucketCount[k] = (long) a[9 + k];
      bucketCorrect[k] = (long) a[9 + n + k];
      bucketLoss[k] = a[9 + 2 * n + k];
    }
  }

  /** Distances of bucket k: [bucketLow(k), 2 * bucketLow(k)). */
  public static long bucketLow(int k) {
    return 1L << k;
  }

  /** Accuracy in bucket k (0 when empty). */
  public double bucketAccuracy(int k) {
    return bucketCount[k] == 0 ? 0 : (double) bucketCorrect[k] / bucketCount[k];
  }

  @Override
  public String toString() {
    return String.format("loss %.4f perplexity %.3f accuracy %.4f (%d tokens)", loss, perplexity, accuracy, tokens);
  }
}
