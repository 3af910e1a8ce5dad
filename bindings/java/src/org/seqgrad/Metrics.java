package org.seqgrad;

/** Result of a training call. */
public final class Metrics {
  /** Mean token loss of the batch. */
  public final double loss;
  /** Labelled tokens of the batch. */
  public final long tokens;
  /** The gradient's global norm before clipping (0 without gradients). */
  public final double gradNorm;
  /** Optimizer steps taken after the call. */
  public final long step;
  /** Peak engine memory of the call. */
  public final long peakBytes;
  /** Wall time of the call. */
  public final double seconds;
  /** Chunks the batch's sequences were split into (full, ckpt: one per sequence). */
  public final long chunks;
  /** Of which were backpropagated: fewer than {@link #chunks} only for spaco. */
  public final long chunksBackpropagated;
  /**
   * adjoint (forms "pairs", "paper"): the vector-Jacobian products (t, i) per channel, summed over layers and
   * sequences; 0 for the other strategies and for evaluate.
   */
  public final long adjointPairs;
  /** The (scheduled) learning rate of this call's optimizer step; 0 when none ran. */
  public final double lr;
  /**
   * Batches whose gradients this call's optimizer step used: 1 after computeGradients/step, the number of
   * accumulateGradients calls since the last step after accumulation; 0 when no optimizer step ran.
   */
  public final long microBatches;
  /** Ranks the model is split over ({@link Trainer.Options#tp}; 1 without tensor parallelism). */
  public final long tp;
  /** Bytes this rank sent to its tensor-parallel group in the call (its all-reduces); 0 without. */
  public final long tpBytesReduced;
  /**
   * Each memory category's own peak, in the order of {@link Model#memoryCategories()}; with {@link Trainer.Options#tp}
   * &gt; 1 this rank's (its blocks and KV heads).
   */
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
    chunks = (long) a[6];
    chunksBackpropagated = (long) a[7];
    adjointPairs = (long) a[8];
    lr = a[9];
    microBatches = (long) a[10];
    tp = (long) a[11];
    tpBytesReduced = (long) a[12];
    final int head = 13;  // the scalars above; then the two per-category arrays (layout: seqgrad_jni.cc)
    int n = (a.length - head) / 2;
    peakBytesByCategory = new long[n];
    bytesAtPeakByCategory = new long[n];
    for (int i = 0; i < n; ++i) {
      peakBytesByCategory[i] = (long) a[head + i];
      bytesAtPeakByCategory[i] = (long) a[head + n + i];
    }
  }

  @Override
  public String toString() {
    return String.format("step %d loss %.4f tokens %d grad_norm %.4f chunks %d/%d peak %d B", step, loss, tokens,
        gradNorm, chunksBackpropagated, chunks, peakBytes);
  }
}
