package org.seqgrad;

import java.util.List;

/**
 * Gradients with a strategy ("full", "ckpt", "seco", "spaco") and AdamW steps. One step at a time: a step while another
 * thread's step runs throws SeqgradException with code BUSY. {@link #cancel()} may be called from any thread.
 */
public final class Trainer extends NativeHandle {
  /** Progress events, called on the stepping thread (phase 0 = gradients computed, 1 = optimizer step done). */
  public interface ProgressListener {
    void onProgress(long step, double loss, long tokens, double gradNorm, int phase);
  }

  /** Trainer options (defaults as in the C API's sg_trainer_default_options). */
  public static final class Options {
    public String strategy = "full";
    public long chunk = 512;
    public long pageSize = 256;
    public long lmChunk = 256;
    public double lr = 1e-3;
    public double beta1 = 0.9;
    public double beta2 = 0.95;
    public double eps = 1e-8;
    public double weightDecay = 0.0;
    public double clipGradNorm = 1.0;
    /** spaco: chunks backpropagated per sequence on average, in [1, chunks of every sequence]. */
    public long spacoBudget = 8;
    /** spaco: cap on the compensation of relayed state gradients; 0 = none (exactly unbiased), else >= 1. */
    public double spacoCap = 2.0;
    /** spaco sampling seed (all 64 bits are used, as unsigned). */
    public long seed = 0;

    public Options strategy(String s) { strategy = s; return this; }
    public Options chunk(long c) { chunk = c; return this; }
    public Options pageSize(long p) { pageSize = p; return this; }
    public Options lr(double v) { lr = v; return this; }
    public Options spacoBudget(long b) { spacoBudget = b; return this; }
    public Options spacoCap(double c) { spacoCap = c; return this; }
    public Options seed(long s) { seed = s; return this; }
  }

  private volatile ProgressListener listener;

  private Trainer(long h) {
    super(h, "Trainer");
  }

  public static Trainer create(Model model, Options o) {
    long mh = model.handleForTrainer();
    try {
      Holder holder = new Holder();
      long h = NativeApi.trainerCreate(holder, mh, o.strategy, o.chunk, o.pageSize, o.lmChunk, o.lr, o.beta1,
          o.beta2, o.eps, o.weightDecay, o.clipGradNorm, o.spacoBudget, o.spacoCap, o.seed);
      return holder.bind(new Trainer(h));
    } finally {
      model.releaseForTrainer();
    }
  }

  public void setProgressListener(ProgressListener l) {
    listener = l;
  }

  // Called from JNI (via the holder) on the stepping thread.
  void onProgress(long step, double loss, long tokens, double gradNorm, int phase) {
    ProgressListener l = listener;
    if (l != null) l.onProgress(step, loss, tokens, gradNorm, phase);
  }

  /** Gradients + optimizer step. labels may be null (next-token labels). */
  public Metrics step(int[] ids, int[] labels, long[] lengths) {
    return run(1, ids, labels, lengths);
  }

  public Metrics computeGradients(int[] ids, int[] labels, long[] lengths) {
    return run(0, ids, labels, lengths);
  }

  public Metrics optimizerStep() {
    return run(2, null, null, null);
  }

  /** A batch of sequences with next-token labels. */
  public Metrics step(List<int[]> sequences) {
    int total = 0;
    for (int[] s : sequences) total += s.length;
    int[] ids = new int[total];
    long[] lengths = new long[sequences.size()];
    int off = 0;
    for (int i = 0; i < sequences.size(); ++i) {
      int[] s = sequences.get(i);
      System.arraycopy(s, 0, ids, off, s.length);
      off += s.length;
      lengths[i] = s.length;
    }
    return step(ids, null, lengths);
  }

  private Metrics run(int mode, int[] ids, int[] labels, long[] lengths) {
    long h = acquire();
    try {
      return new Metrics(NativeApi.trainerRun(h, mode, ids, labels, lengths));
    } finally {
      release();
    }
  }

  /** Stops the running step (it throws SeqgradException CANCELLED), or the next one. Thread-safe. */
  public void cancel() {
    long h = acquire();  // keeps the handle alive during the call; throws if closed
    try {
      NativeApi.trainerCancel(h);
    } finally {
      release();
    }
  }

  public long stepCount() {
    long h = acquire();
    try {
      return NativeApi.trainerStepCount(h);
    } finally {
      release();
    }
  }

  @Override
  void free(long h) {
    NativeApi.trainerFree(h);
  }

  /** Receives progress events before the Trainer object exists (JNI keeps a global ref to it until close). */
  static final class Holder {
    private volatile Trainer trainer;

    Trainer bind(Trainer t) {
      trainer = t;
      return t;
    }

    void onProgress(long step, double loss, long tokens, double gradNorm, int phase) {
      Trainer t = trainer;
      if (t != null) t.onProgress(step, loss, tokens, gradNorm, phase);
    }
  }
}
