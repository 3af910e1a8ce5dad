package org.seqgrad;

import java.util.List;

/**
 * Since 0.5: a learning-rate schedule ({@link Options#lrSchedule}), gradient accumulation ({@link
 * #accumulateGradients} then {@link #optimizerStep}), checkpoints ({@link #saveCheckpoint}, {@link #loadCheckpoint},
 * {@link #resume}: a resumed run continues with the same losses on CPU; a damaged checkpoint throws {@link
 * DataLossException}, one of another run configuration {@link FailedPreconditionException} listing the fields) and
 * {@link #evaluateDetailed} (perplexity, accuracy, retrieval accuracy by key-query distance).
 *
 * <p>Gradients with a strategy ("full", "ckpt", "seco", "spaco", "streambp", "adjoint": SSMs only, see {@link
 * Options#adjointForm}) for an objective ("sft", "dpo", "grpo") and AdamW steps. sft trains with {@link #step}/{@link
 * #computeGradients}, dpo with {@link #stepDpo}/{@link #computeGradientsDpo}, grpo with {@link #stepGrpo}/{@link
 * #computeGradientsGrpo}; the other calls throw {@link FailedPreconditionException}. One step at a time: a step while
 * another thread's step runs throws SeqgradException with code BUSY. {@link #cancel()} may be called from any thread.
 * A step past the model's memory limit throws {@link ResourceExhaustedException}.
 */
public final class Trainer extends NativeHandle {
  /** Progress events, called on the stepping thread (phase 0 = gradients computed, 1 = optimizer step done). */
  public interface ProgressListener {
    void onProgress(long step, double loss, long tokens, double gradNorm, int phase);
  }

  /** Trainer options (defaults as in the C API's sg_trainer_default_options). */
  public static final class Options {
    /** {@link #adjointWindow} of no truncation (the C API's INT64_MAX). */
    public static final long NO_ADJOINT_WINDOW = Long.MAX_VALUE;

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
    /** "sft", "dpo" or "grpo", fixed for the trainer's lifetime. */
    public String objective = "sft";
    /** dpo: beta of -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))); > 0. */
    public double dpoBeta = 0.1;
    /** grpo: the ratio is clipped to [1 - eps, 1 + eps]; in (0, 1). */
    public double grpoClipEps = 0.2;
    /** grpo: weight of the KL penalty to the reference; 0 = none (and no reference needed). */
    public double grpoKlBeta = 0.04;
    /** dpo/grpo: the frozen reference model (another model with the same vocabulary), or null. */
    public Model reference = null;
    /**
     * adjoint (state-space models only; a transformer throws {@link InvalidArgumentException}): "pairs" (adjoint
     * sharding over the (t, i) pairs), "scan" (one reverse scan per chunk, exact, takes no window) or "paper" (the
     * paper's multi-layer formula, exact for one layer only); null = "pairs".
     */
    public String adjointForm = "pairs";
    /**
     * adjoint: keeps only the pairs with t - i < adjointWindow tokens (w T - w (w - 1) / 2 per layer and channel for a
     * sequence of T tokens); must be > 0; {@link #NO_ADJOINT_WINDOW} (the default) = no truncation.
     */
    public long adjointWindow = NO_ADJOINT_WINDOW;
    /**
     * Learning-rate schedule after {@link #warmupSteps} steps of linear warmup: "constant" (lr), "cosine" or "linear"
     * decay from lr to {@link #minLr} at {@link #totalSteps}; null = "constant".
     */
    public String lrSchedule = "constant";
    public long warmupSteps = 0;
    /** The floor of the decaying schedules, in [0, lr]. */
    public double minLr = 0;
    /** The decay's horizon in optimizer steps (cosine and linear need > warmupSteps). */
    public long totalSteps = 0;
    /**
     * Micro-batches the caller accumulates per optimizer step ({@link Trainer#accumulateGradients}); >= 1. Recorded in
     * checkpoints' run configuration; the library does not split batches.
     */
    public long gradAccum = 1;
    /**
     * seco on transformers (SeCOv2): each query chunk attends, per layer, to page 0, its own pages and the one
     * before, and the {@code sparsePages} other earlier pages of highest score; 0 = dense.
     */
    public long sparsePages = 0;
    /** seco on transformers: every layer's KV and KV-gradient pages in host memory, a few layers on the device. */
    public boolean offload = false;

    public Options strategy(String s) { strategy = s; return this; }
    public Options chunk(long c) { chunk = c; return this; }
    public Options pageSize(long p) { pageSize = p; return this; }
    public Options lr(double v) { lr = v; return this; }
    public Options spacoBudget(long b) { spacoBudget = b; return this; }
    public Options spacoCap(double c) { spacoCap = c; return this; }
    public Options seed(long s) { seed = s; return this; }
    public Options objective(String o) { objective = o; return this; }
    public Options dpoBeta(double b) { dpoBeta = b; return this; }
    public Options grpoClipEps(double e) { grpoClipEps = e; return this; }
    public Options grpoKlBeta(double b) { grpoKlBeta = b; return this; }
    public Options reference(Model m) { reference = m; return this; }
    public Options adjointForm(String f) { adjointForm = f; return this; }
    public Options adjointWindow(long w) { adjointWindow = w; return this; }
    public Options lrSchedule(String s) { lrSchedule = s; return this; }
    public Options warmupSteps(long w) { warmupSteps = w; return this; }
    public Options minLr(double v) { minLr = v; return this; }
    public Options totalSteps(long s) { totalSteps = s; return this; }
    public Options gradAccum(long g) { gradAccum = g; return this; }
    public Options sparsePages(long k) { sparsePages = k; return this; }
    public Options offload(boolean o) { offload = o; return this; }
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
          o.beta2, o.eps, o.weightDecay, o.clipGradNorm, o.spacoBudget, o.spacoCap, o.seed, o.objective, o.dpoBeta,
          o.grpoClipEps, o.grpoKlBeta, o.adjointForm, o.adjointWindow, o.lrSchedule, o.warmupSteps, o.minLr,
          o.totalSteps, o.gradAccum, o.sparsePages, o.offload);
      Trainer t = holder.bind(new Trainer(h));
      if (o.reference != null) {
        try {
          t.setReference(o.reference);
        } catch (RuntimeException e) {
          t.close();
          throw e;
        }
      }
      return t;
    } finally {
      model.releaseForTrainer();
    }
  }

  /**
   * Sets the frozen reference model of dpo/grpo (another model with the same vocabulary), used where the batch gives no
   * reference log-probs; null clears it. The trainer keeps the native reference alive.
   */
  public void setReference(Model reference) {
    long h = acquire();
    try {
      if (reference == null) {
        NativeApi.trainerSetReference(h, 0);
        return;
      }
      long rh = reference.handleForTrainer();
      try {
        NativeApi.trainerSetReference(h, rh);
      } finally {
        reference.releaseForTrainer();
      }
    } finally {
      release();
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

  /**
   * The batch's mean token loss without gradients (chunked forward); the batch as in {@link #step(int[], int[],
   * long[])}. Gradients and the optimizer are left alone; any objective.
   */
  public Metrics evaluate(int[] ids, int[] labels, long[] lengths) {
    return run(3, ids, labels, lengths);
  }

  /**
   * Adds the gradient of one micro-batch (zeroing the gradients first when no accumulation is pending); {@link
   * #optimizerStep} then steps as on one batch holding every micro-batch (its metrics report {@code microBatches}).
   * Returns the micro-batch's metrics (its own mean loss).
   */
  public Metrics accumulateGradients(int[] ids, int[] labels, long[] lengths) {
    return run(4, ids, labels, lengths);
  }

  /** {@link #accumulateGradients(int[], int[], long[])} of sequences with next-token labels. */
  public Metrics accumulateGradients(List<int[]> sequences) {
    Flat f = new Flat(sequences);
    return accumulateGradients(f.ids, null, f.lengths);
  }

  /** A DPO step (objective "dpo") on preference pairs, then AdamW; loss = mean over pairs of -log sigmoid(z). */
  public Metrics stepDpo(List<DpoPair> pairs) {
    return dpo(1, pairs);
  }

  /** {@link #stepDpo} without the optimizer step. */
  public Metrics computeGradientsDpo(List<DpoPair> pairs) {
    return dpo(0, pairs);
  }

  /** {@link #accumulateGradients(int[], int[], long[])} for objective "dpo". */
  public Metrics accumulateGradientsDpo(List<DpoPair> pairs) {
    return dpo(4, pairs);
  }

  /** A GRPO step (objective "grpo") on groups (the G >= 1 completions of one prompt each), then AdamW. */
  public Metrics stepGrpo(List<List<GrpoCompletion>> groups) {
    return grpo(1, groups);
  }

  /** {@link #stepGrpo} without the optimizer step. */
  public Metrics computeGradientsGrpo(List<List<GrpoCompletion>> groups) {
    return grpo(0, groups);
  }

  /** {@link #accumulateGradients(int[], int[], long[])} for objective "grpo". */
  public Metrics accumulateGradientsGrpo(List<List<GrpoCompletion>> groups) {
    return grpo(4, groups);
  }

  /**
   * Held-out evaluation without gradients (the batch as in {@link #step(int[], int[], long[])}): loss, perplexity,
   * accuracy and, when {@code distances} (aligned with ids; at every labelled position the distance >= 1 from the key
   * the label is retrieved from, ignored elsewhere) is not null, accuracy per distance bucket.
   */
  public EvalResult evaluateDetailed(int[] ids, int[] labels, long[] lengths, long[] distances) {
    if (distances != null && ids != null && distances.length != ids.length) {
      throw new InvalidArgumentException("distances has " + distances.length + " entries but ids has " + ids.length);
    }
    long h = acquire();
    try {
      return new EvalResult(NativeApi.trainerEvaluateDetailed(h, ids, labels, lengths, distances));
    } finally {
      release();
    }
  }

  /**
   * Writes outDir/checkpoint-&lt;stepCount&gt; atomically (weights and adapters, AdamW moments, step, sampling counter,
   * dataPosition, run configuration) and keeps the {@code keep} newest (0 = all). dataPosition: where the caller is in
   * its data, returned by {@link #loadCheckpoint}/{@link #resume}. Returns the checkpoint's directory.
   */
  public String saveCheckpoint(String outDir, long dataPosition, int keep) {
    long h = acquire();
    try {
      NativeApi.trainerSaveCheckpoint(h, outDir, dataPosition, keep);
      return outDir + "/checkpoint-" + NativeApi.trainerStepCount(h);
    } finally {
      release();
    }
  }

  /**
   * Restores a checkpoint-&lt;step&gt; directory into this trainer and its model. {@link DataLossException}: corrupt or
   * truncated; {@link FailedPreconditionException}: another run configuration (the differing fields listed) or other
   * shapes; {@link NotFoundException}: no such directory.
   */
  public CheckpointState loadCheckpoint(String checkpointDir) {
    long h = acquire();
    try {
      long[] r = NativeApi.trainerLoadCheckpoint(h, checkpointDir);
      return new CheckpointState(r[0], r[1]);
    } finally {
      release();
    }
  }

  /**
   * {@link #loadCheckpoint} of the newest complete checkpoint in outDir (damaged newer ones are skipped). None there:
   * null when {@code missingOk}, else {@link NotFoundException}.
   */
  public CheckpointState resume(String outDir, boolean missingOk) {
    long h = acquire();
    try {
      long[] r = NativeApi.trainerResume(h, outDir);
      return new CheckpointState(r[0], r[1]);
    } catch (NotFoundException e) {
      if (missingOk) return null;
      throw e;
    } finally {
      release();
    }
  }

  private static void checkSequence(int[] ids, int[] labels, String what, String idsName, String labelsName) {
    if (ids == null) throw new InvalidArgumentException(what + "." + idsName + " is null");
    if (labels != null && labels.length != ids.length) {
      throw new InvalidArgumentException(what + "." + labelsName + " has " + labels.length + " entries but "
          + idsName + " has " + ids.length);
    }
  }

  private static void checkLogprobs(double[] lp, int length, String what) {
    if (lp != null && lp.length != length) {
      throw new InvalidArgumentException(what + " has " + lp.length + " entries but the sequence has " + length
          + " tokens (one per position, aligned with labels)");
    }
  }

  private Metrics dpo(int mode, List<DpoPair> pairs) {
    if (pairs == null || pairs.isEmpty()) throw new InvalidArgumentException("pairs is empty; need at least 1 pair");
    int n = pairs.size();
    int[][] ci = new int[n][], cl = new int[n][], ri = new int[n][], rl = new int[n][];
    double[] rc = new double[n], rr = new double[n];
    for (int i = 0; i < n; ++i) {
      DpoPair p = pairs.get(i);
      String what = "pairs[" + i + "]";
      if (p == null) throw new InvalidArgumentException(what + " is null");
      checkSequence(p.chosenIds, p.chosenLabels, what, "chosenIds", "chosenLabels");
      checkSequence(p.rejectedIds, p.rejectedLabels, what, "rejectedIds", "rejectedLabels");
      ci[i] = p.chosenIds;
      cl[i] = p.chosenLabels;
      ri[i] = p.rejectedIds;
      rl[i] = p.rejectedLabels;
      rc[i] = p.refChosenLogp;
      rr[i] = p.refRejectedLogp;
    }
    long h = acquire();
    try {
      return new Metrics(NativeApi.trainerDpo(h, mode, ci, cl, ri, rl, rc, rr));
    } finally {
      release();
    }
  }

  private Metrics grpo(int mode, List<List<GrpoCompletion>> groups) {
    if (groups == null || groups.isEmpty()) {
      throw new InvalidArgumentException("groups is empty; need at least 1 group");
    }
    long[] offsets = new long[groups.size() + 1];
    for (int g = 0; g < groups.size(); ++g) {
      List<GrpoCompletion> group = groups.get(g);
      if (group == null || group.isEmpty()) {
        throw new InvalidArgumentException("groups[" + g + "] is empty (G = 0); every group needs at least 1 "
            + "completion");
      }
      offsets[g + 1] = offsets[g] + group.size();
    }
    int n = (int) offsets[groups.size()];
    int[][] ids = new int[n][], labels = new int[n][];
    double[] advantages = new double[n];
    double[][] old = new double[n][], ref = new double[n][];
    int c = 0;
    for (int g = 0; g < groups.size(); ++g) {
      List<GrpoCompletion> group = groups.get(g);
      for (int i = 0; i < group.size(); ++i, ++c) {
        GrpoCompletion x = group.get(i);
        String what = "groups[" + g + "][" + i + "]";
        if (x == null) throw new InvalidArgumentException(what + " is null");
        checkSequence(x.ids, x.labels, what, "ids", "labels");
        checkLogprobs(x.oldLogprobs, x.ids.length, what + ".oldLogprobs");
        checkLogprobs(x.refLogprobs, x.ids.length, what + ".refLogprobs");
        ids[c] = x.ids;
        labels[c] = x.labels;
        advantages[c] = x.advantage;
        old[c] = x.oldLogprobs;
        ref[c] = x.refLogprobs;
      }
    }
    long h = acquire();
    try {
      return new Metrics(NativeApi.trainerGrpo(h, mode, ids, labels, advantages, old, ref, offsets));
    } finally {
      release();
    }
  }

  /** Sequences concatenated, with their lengths. */
  private static final class Flat {
    final int[] ids;
    final long[] lengths;

    Flat(List<int[]> sequences) {
      int total = 0;
      for (int[] s : sequences) total += s.length;
      ids = new int[total];
      lengths = new long[sequences.size()];
      int off = 0;
      for (int i = 0; i < sequences.size(); ++i) {
        int[] s = sequences.get(i);
        System.arraycopy(s, 0, ids, off, s.length);
        off += s.length;
        lengths[i] = s.length;
      }
    }
  }

  /** A batch of sequences with next-token labels. */
  public Metrics step(List<int[]> sequences) {
    Flat f = new Flat(sequences);
    return step(f.ids, null, f.lengths);
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
