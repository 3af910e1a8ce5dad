package org.seqgrad;

/** Result of a training call. */
public final class Metrics {
  public final double loss;
  public final long tokens;
  public final double gradNorm;
  public final long step;
  public final long peakBytes;
  public final double seconds;
  /** Each memory category's own peak, in the order of {@link Model#memoryCategories()}. */
  public final long[] peakBytesByCategory;
  /** The split of peakBytes over the categories. */
  public final long[] bytesAtPeakByCategory;

  Metrics(double[] a) {
    loss = a[0];
    tokens = (long) a[1];
    gradNorm = a[2];
    step = (long) a[3];
    peakBytes = (long) a[4];
    seconds = a[5];
    int n = (a.length - 6) / 2;
    peakBytesByCategory = new long[n];
    bytesAtPeakByCategory = new long[n];
    for (int i = 0; i < n; ++i) {
      peakBytesByCategory[i] = (long) a[6 + i];
      bytesAtPeakByCategory[i] = (long) a[6 + n + i];
    }
  }

  @Override
  public String toString() {
    return String.format("step %d loss %.4f tokens %d grad_norm %.4f peak %d B", step, loss, tokens, gradNorm,
        peakBytes);
  }
}
