package org.seqgrad;

import java.lang.ref.WeakReference;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

/**
 * Trains a {@link Model}: gradients with a strategy ("full", "ckpt", "seco", "spaco", "streambp", "adjoint": SSMs only,
 * see {@link Options#adjointForm}) for an objective ("sft", "dpo", "grpo") and AdamW steps. sft trains with {@link
 * #step}/{@link #computeGradients}, dpo with {@link #stepDpo}/{@link #computeGradientsDpo}, grpo with {@link
 * #stepGrpo}/{@link #computeGradientsGrpo}; the other calls throw {@link FailedPreconditionException}. One step at a
 * time: a step while another thread's step runs throws {@link BusyException}. {@link #cancel()} may be called from any
 * thread. A step past the model's memory limit throws {@link ResourceExhaustedException}.
 *
 * <p>Labels follow Hugging Face's convention in every call that takes them (since 0.7): aligned with the ids
 * ({@code labels[t]} is the token at position t, -100 = ignored) and shifted by the library within each sequence
 * (position t is trained to predict {@code labels[t + 1]}, so a sequence's {@code labels[0]} is never predicted);
 * null labels are next-token labels, the same as {@code labels = ids}.
 *
 * <p>{@link #score} gives the per-token log-probs of a batch (for GRPO's old-policy and reference log-probs, and
 * scoring). {@link Options#numThreads} sets the thread count; on a machine shared with other processes, start the JVM
 * with the environment variable {@code OMP_WAIT_POLICY=PASSIVE}.
 *
 * <p>Close a trainer when done ({@link AutoCloseable}); one that is never closed is freed once it is unreachable.
 *
 * <p>Since 0.5: a learning-rate schedule ({@link Options#lrSchedule}), gradient accumulation ({@link
 * #accumulateGradients} then {@link #optimizerStep}), checkpoints ({@link #saveCheckpoint}, {@link #loadCheckpoint},
 * {@link #resume}: a resumed run continues with the same losses on CPU; a damaged checkpoint throws {@link
 * DataLossException}, one of another run configuration {@link FailedPreconditionException} listing the fields) and
 * {@link #evaluateDetailed} (perplexity, accuracy, retrieval accuracy by key-query distance).
 */
public final class Trainer extends NativeHandle {
  /** Progress events, called on the stepping thread. */
  public interface ProgressListener {
    /**
     * One event.
     *
     * @param step the optimizer step count
     * @param loss the batch's mean token loss
     * @param tokens labelled tokens of the batch
     * @param gradNorm the gradient's global norm (before clipping)
     * @param phase 0 = gradients computed, 1 = optimizer step done
     */
    void onProgress(long step, double loss, long tokens, double gradNorm, int phase);
  }

  /**
   * Trainer options, public fields with chainable setters (defaults as in the C API's sg_trainer_default_options).
   * Bad values throw {@link InvalidArgumentException} naming the option from {@link Trainer#create}. The native layer
   * reads the fields by name: each of the C API's sg_trainer_options fields in camelCase ({@code page_size}: {@link
   * #pageSize}), with the Java type of its kind (String, long, int, double, boolean).
   */
  public static final class Options {
    /** Options with the defaults. */
    public Options() {}

    /** {@link #adjointWindow} of no truncation (the C API's INT64_MAX). */
    public static final long NO_ADJOINT_WINDOW = Long.MAX_VALUE;

    /** Gradient strategy: "full", "ckpt", "seco", "spaco", "streambp" or "adjoint" (SSMs only). */
    public String strategy = "full";
    /** Tokens per chunk of the chunked strategies. */
    public long chunk = 512;
    /** Tokens per KV-cache page (transformers). */
    public long pageSize = 256;
    /** Tokens per chunk of the LM head's logits (never T x vocab at once). */
    public long lmChunk = 256;
    /** AdamW learning rate (the peak of a schedule). */
    public double lr = 1e-3;
    /** AdamW beta1. */
    public double beta1 = 0.9;
    /** AdamW beta2. */
    public double beta2 = 0.95;
    /** AdamW epsilon. */
    public double eps = 1e-8;
    /** AdamW decoupled weight decay. */
    public double weightDecay = 0.0;
    /** Clips the gradient's global norm to this; 0 = no clipping. */
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
    /**
     * grpo: the KL term times the importance ratio r_t (TRL's use_bias_correction_kl and its default: the unbiased
     * reverse-KL gradient); false = plain k3.
     */
    public boolean grpoKlBiasCorrection = true;
    /** dpo/grpo: the frozen reference model (another model with the same vocabulary), or null. */
    public Model reference = null;
    /**
     * adjoint (state-space models only; a transformer throws {@link InvalidArgumentException}): "pairs" (adjoint
     * sharding over the (t, i) pairs), "scan" (one reverse scan per chunk, exact, takes no window) or "paper" (the
     * paper's multi-layer formula, exact for one layer only); null = "pairs".
     */
    public String adjointForm = "pairs";
    /**
     * adjoint: keeps only the pairs with t - i &lt; adjointWindow tokens (w T - w (w - 1) / 2 per layer and channel
     * for a sequence of T tokens); must be &gt; 0; {@link #NO_ADJOINT_WINDOW} (the default) = no truncation.
     */
    public long adjointWindow = NO_ADJOINT_WINDOW;
    /**
     * Learning-rate schedule after {@link #warmupSteps} steps of linear warmup: "constant" (lr), "cosine" or "linear"
     * decay from lr to {@link #minLr} at {@link #totalSteps}; null = "constant".
     */
    public String lrSchedule = "constant";
    /** Optimizer steps of linear warmup from 0 to lr. */
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
    /**
     * Mixtures of experts under LoRA: the frozen expert weights in host memory, streamed through the device two MoE
     * layers' worth at a time (the same gradients).
     */
    public boolean offloadExperts = false;
    /**
     * OpenMP/OpenBLAS threads of this trainer's calls, set on the calling thread around each call and restored after
     * it; &gt;= 0, 0 = the caller's default ({@code OMP_NUM_THREADS}, else one per core). Checkpoints record it: a
     * resume with another count trains on but is no longer bit-identical to an uninterrupted run. On a machine shared
     * with other processes, start the JVM with the environment variable {@code OMP_WAIT_POLICY=PASSIVE} (the OpenMP
     * runtime reads it once, when the native library loads, and a JVM cannot set its own environment): with the
     * default spin-waiting, idle threads keep cores busy and a step can be many times slower when another process
     * competes for the CPU.
     */
    public int numThreads = 0;
    /**
     * Tensor parallelism (transformers; CPU or "cuda" models): 1 (the default) = one process; N &gt; 1 in a JVM launched as one of the
     * N ranks of {@code mpirun -np N java ...}: {@link #create} joins the MPI job and keeps this rank's blocks of the
     * model (1/N of the heads, KV cache, SwiGLU width and vocabulary). Every rank must create the same model and
     * trainer and make the same calls with the same batches. The {@link Model} keeps showing the whole model
     * (parameters and gradients are gathered after each call); {@link Model#save}, {@link Trainer#saveCheckpoint},
     * loadCheckpoint and resume are then collective: every rank calls them and rank 0 alone writes the whole model.
     * {@link Metrics}' memory is this rank's; {@link Metrics#tp} and {@link Metrics#tpBytesReduced} report the split.
     * tp not dividing the heads or vocabulary, a job that is not tp ranks, or ranks disagreeing: an exception on every
     * rank with the numbers. docs/distributed.md, "Tensor parallel".
     */
    public long tp = 1;

    /** Sets {@link #strategy}; returns these options. */
    public Options strategy(String s) { strategy = s; return this; }
    /** Sets {@link #chunk}; returns these options. */
    public Options chunk(long c) { chunk = c; return this; }
    /** Sets {@link #pageSize}; returns these options. */
    public Options pageSize(long p) { pageSize = p; return this; }
    /** Sets {@link #lr}; returns these options. */
    public Options lr(double v) { lr = v; return this; }
    /** Sets {@link #spacoBudget}; returns these options. */
    public Options spacoBudget(long b) { spacoBudget = b; return this; }
    /** Sets {@link #spacoCap}; returns these options. */
    public Options spacoCap(double c) { spacoCap = c; return this; }
    /** Sets {@link #seed}; returns these options. */
    public Options seed(long s) { seed = s; return this; }
    /** Sets {@link #objective}; returns these options. */
    public Options objective(String o) { objective = o; return this; }
    /** Sets {@link #dpoBeta}; returns these options. */
    public Options dpoBeta(double b) { dpoBeta = b; return this; }
    /** Sets {@link #grpoClipEps}; returns these options. */
    public Options grpoClipEps(double e) { grpoClipEps = e; return this; }
    /** Sets {@link #grpoKlBeta}; returns these options. */
    public Options grpoKlBeta(double b) { grpoKlBeta = b; return this; }
    /** Sets {@link #grpoKlBiasCorrection}; returns these options. */
    public Options grpoKlBiasCorrection(boolean on) { grpoKlBiasCorrection = on; return this; }
    /** Sets {@link #reference}; returns these options. */
    public Options reference(Model m) { reference = m; return this; }
    /** Sets {@link #adjointForm}; returns these options. */
    public Options adjointForm(String f) { adjointForm = f; return this; }
    /** Sets {@link #adjointWindow}; returns these options. */
    public Options adjointWindow(long w) { adjointWindow = w; return this; }
    /** Sets {@link #lrSchedule}; returns these options. */
    public Options lrSchedule(String s) { lrSchedule = s; return this; }
    /** Sets {@link #warmupSteps}; returns these options. */
    public Options warmupSteps(long w) { warmupSteps = w; return this; }
    /** Sets {@link #minLr}; returns these options. */
    public Options minLr(double v) { minLr = v; return this; }
    /** Sets {@link #totalSteps}; returns these options. */
    public Options totalSteps(long s) { totalSteps = s; return this; }
    /** Sets {@link #gradAccum}; returns these options. */
    public Options gradAccum(long g) { gradAccum = g; return this; }
    /** Sets {@link #sparsePages}; returns these options. */
    public Options sparsePages(long k) { sparsePages = k; return this; }
    /** Sets {@link #offload}; returns these options. */
    public Options offload(boolean o) { offload = o; return this; }
    /** Sets {@link #offloadExperts}; returns these options. */
    public Options offloadExperts(boolean o) { offloadExperts = o; return this; }
    /** Sets {@link #numThreads}; returns these options. */
    public Options numThreads(int n) { numThreads = n; return this; }
    /** Sets {@link #tp}; returns these options. */
    public Options tp(long n) { tp = n; return this; }
  }

  private volatile ProgressListener listener;

  private Trainer(long h, long modelParamBytes) {
    super(h, "Trainer", NativeApi::trainerFree, 2 * modelParamBytes);  // the optimizer's two moments
  }

  /**
   * A trainer of the model. It keeps the native model alive: closing the model while the trainer lives is safe. Close
   * the trainer when done; one that is never closed is freed once it is unreachable.
   *
   * @param model the model to train
   * @param o the options
   * @return the trainer
   * @throws InvalidArgumentException for a null argument or a bad option (the message names it)
   */
  public static Trainer create(Model model, Options o) {
    SeqgradException.notNull(model, "Trainer.create: model");
    SeqgradException.notNull(o, "Trainer.create: options");
    long mh = model.handleForTrainer();
    try {
      Holder holder = new Holder();
      long h = NativeApi.trainerCreate(holder, mh, o);
      Trainer t = holder.bind(new Trainer(h, NativeApi.modelParamBytes(mh)));
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
   * reference log-probs. The trainer keeps the native reference alive.
   *
   * @param reference the reference model; null clears it
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

  /**
   * Receives progress events of this trainer's calls.
   *
   * @param l the listener; null = none. An exception it throws ends the call's events; when the call then completes
   *     (its step or gradients are in place), the call throws {@link StepAppliedException} with that exception as
   *     its cause, so that a caller does not retry the batch; when the call fails, the exception itself.
   */
  public void setProgressListener(ProgressListener l) {
    listener = l;
  }

  // Called from JNI (via the holder) on the stepping thread.
  void onProgress(long step, double loss, long tokens, double gradNorm, int phase) {
    ProgressListener l = listener;
    if (l != null) l.onProgress(step, loss, tokens, gradNorm, phase);
  }

  /**
   * Gradients of a batch, then an AdamW step.
   *
   * @param ids the sequences' token ids, concatenated
   * @param labels Hugging Face's labels, aligned with ids and shifted by the library per sequence (labels[t] is the
   *     token at position t, -100 = ignored; see {@link Trainer}); null = next-token labels
   * @param lengths each sequence's length (summing to ids.length)
   * @return the call's metrics
   */
  public Metrics step(int[] ids, int[] labels, long[] lengths) {
    return run(1, ids, labels, lengths, null);
  }

  /**
   * {@link #step(int[], int[], long[])} of sequences that pack documents: each document trains as if alone
   * (attention within the document, RoPE positions restarting, no label crossing into the next document). The
   * document overloads of computeGradients, evaluate, accumulateGradients, evaluateDetailed and score take docLengths
   * the same way.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param docLengths null, or one entry per sequence: null (one document) or the lengths of its documents, summing
   *     to its length; bad lengths throw {@link InvalidArgumentException} naming them ("doc_lengths[s][d] = 0")
   * @return the call's metrics
   */
  public Metrics step(int[] ids, int[] labels, long[] lengths, long[][] docLengths) {
    return run(1, ids, labels, lengths, docLengths);
  }

  /**
   * Gradients of a batch (into {@link Model#grad}) without the optimizer step.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @return the call's metrics
   */
  public Metrics computeGradients(int[] ids, int[] labels, long[] lengths) {
    return run(0, ids, labels, lengths, null);
  }

  /**
   * {@link #computeGradients(int[], int[], long[])} of sequences that pack documents.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param docLengths as in {@link #step(int[], int[], long[], long[][])}
   * @return the call's metrics
   */
  public Metrics computeGradients(int[] ids, int[] labels, long[] lengths, long[][] docLengths) {
    return run(0, ids, labels, lengths, docLengths);
  }

  /**
   * An AdamW step on the gradients computed or accumulated since the last step.
   *
   * @return the call's metrics
   */
  public Metrics optimizerStep() {
    return run(2, null, null, null, null);
  }

  /**
   * The batch's mean token loss without gradients (chunked forward); the batch as in {@link #step(int[], int[],
   * long[])}. Gradients and the optimizer are left alone; any objective.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @return the metrics (loss, tokens)
   */
  public Metrics evaluate(int[] ids, int[] labels, long[] lengths) {
    return run(3, ids, labels, lengths, null);
  }

  /**
   * {@link #evaluate(int[], int[], long[])} of sequences that pack documents.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param docLengths as in {@link #step(int[], int[], long[], long[][])}
   * @return the metrics (loss, tokens)
   */
  public Metrics evaluate(int[] ids, int[] labels, long[] lengths, long[][] docLengths) {
    return run(3, ids, labels, lengths, docLengths);
  }

  /**
   * Adds the gradient of one micro-batch (zeroing the gradients first when no accumulation is pending); {@link
   * #optimizerStep} then steps as on one batch holding every micro-batch (its metrics report {@code microBatches}).
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @return the micro-batch's metrics (its own mean loss)
   */
  public Metrics accumulateGradients(int[] ids, int[] labels, long[] lengths) {
    return run(4, ids, labels, lengths, null);
  }

  /**
   * {@link #accumulateGradients(int[], int[], long[])} of sequences that pack documents.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param docLengths as in {@link #step(int[], int[], long[], long[][])}
   * @return the micro-batch's metrics (its own mean loss)
   */
  public Metrics accumulateGradients(int[] ids, int[] labels, long[] lengths, long[][] docLengths) {
    return run(4, ids, labels, lengths, docLengths);
  }

  /**
   * {@link #accumulateGradients(int[], int[], long[])} of sequences with next-token labels.
   *
   * @param sequences the token ids of each sequence
   * @return the micro-batch's metrics
   */
  public Metrics accumulateGradients(List<int[]> sequences) {
    return accumulateGradients(sequences, null);
  }

  /**
   * {@link #accumulateGradients(int[], int[], long[])} of sequences with their labels.
   *
   * @param sequences the token ids of each sequence
   * @param labels as in {@link #step(List, List)}
   * @return the micro-batch's metrics
   */
  public Metrics accumulateGradients(List<int[]> sequences, List<int[]> labels) {
    Flat f = new Flat(sequences, labels, "Trainer.accumulateGradients");
    return accumulateGradients(f.ids, f.labels, f.lengths);
  }

  /**
   * A DPO step (objective "dpo") on preference pairs, then AdamW; loss = mean over pairs of -log sigmoid(z).
   *
   * @param pairs at least one pair
   * @return the call's metrics
   */
  public Metrics stepDpo(List<DpoPair> pairs) {
    return dpo(1, pairs);
  }

  /**
   * {@link #stepDpo} without the optimizer step.
   *
   * @param pairs at least one pair
   * @return the call's metrics
   */
  public Metrics computeGradientsDpo(List<DpoPair> pairs) {
    return dpo(0, pairs);
  }

  /**
   * {@link #accumulateGradients(int[], int[], long[])} for objective "dpo".
   *
   * @param pairs at least one pair
   * @return the micro-batch's metrics
   */
  public Metrics accumulateGradientsDpo(List<DpoPair> pairs) {
    return dpo(4, pairs);
  }

  /**
   * A GRPO step (objective "grpo") on groups, then AdamW.
   *
   * @param groups the G &gt;= 1 completions of one prompt each
   * @return the call's metrics
   */
  public Metrics stepGrpo(List<List<GrpoCompletion>> groups) {
    return grpo(1, groups);
  }

  /**
   * {@link #stepGrpo} without the optimizer step.
   *
   * @param groups as in {@link #stepGrpo}
   * @return the call's metrics
   */
  public Metrics computeGradientsGrpo(List<List<GrpoCompletion>> groups) {
    return grpo(0, groups);
  }

  /**
   * {@link #accumulateGradients(int[], int[], long[])} for objective "grpo".
   *
   * @param groups as in {@link #stepGrpo}
   * @return the micro-batch's metrics
   */
  public Metrics accumulateGradientsGrpo(List<List<GrpoCompletion>> groups) {
    return grpo(4, groups);
  }

  /**
   * Held-out evaluation without gradients (the batch as in {@link #step(int[], int[], long[])}): loss, perplexity,
   * accuracy and, when {@code distances} is not null, accuracy per distance bucket. distances are aligned with ids and
   * labels like the labels: for every label {@code labels[t]} (t &gt;= 1 within its sequence, not -100) the distance
   * &gt;= 1, in tokens, from the key it is retrieved from; ignored elsewhere.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param distances per position, or null
   * @return the result
   */
  public EvalResult evaluateDetailed(int[] ids, int[] labels, long[] lengths, long[] distances) {
    return evaluateDetailed(ids, labels, lengths, distances, null);
  }

  /**
   * {@link #evaluateDetailed(int[], int[], long[], long[])} of sequences that pack documents.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param distances per position, or null
   * @param docLengths as in {@link #step(int[], int[], long[], long[][])}
   * @return the result
   */
  public EvalResult evaluateDetailed(int[] ids, int[] labels, long[] lengths, long[] distances, long[][] docLengths) {
    if (distances != null && ids != null && distances.length != ids.length) {
      throw new InvalidArgumentException("distances has " + distances.length + " entries but ids has " + ids.length);
    }
    long h = acquire();
    try {
      return new EvalResult(NativeApi.trainerEvaluateDetailed(h, ids, labels, lengths, distances, docLengths));
    } finally {
      release();
    }
  }

  /**
   * Writes outDir/checkpoint-&lt;stepCount&gt; atomically (weights and adapters, AdamW moments, step, sampling counter,
   * dataPosition, run configuration) and keeps the {@code keep} newest (0 = all). dataPosition: where the caller is in
   * its data, returned by {@link #loadCheckpoint}/{@link #resume}.
   *
   * @param outDir the run's output directory
   * @param dataPosition the caller's position in its data
   * @param keep checkpoints to keep; 0 = all
   * @return the checkpoint's directory
   */
  public String saveCheckpoint(String outDir, long dataPosition, int keep) {
    SeqgradException.notNull(outDir, "Trainer.saveCheckpoint: outDir");
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
   *
   * @param checkpointDir a checkpoint-&lt;step&gt; directory
   * @return the restored step and data position
   */
  public CheckpointState loadCheckpoint(String checkpointDir) {
    SeqgradException.notNull(checkpointDir, "Trainer.loadCheckpoint: checkpointDir");
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
   *
   * @param outDir the run's output directory
   * @param missingOk whether no checkpoint is fine
   * @return the restored step and data position, or null
   */
  public CheckpointState resume(String outDir, boolean missingOk) {
    SeqgradException.notNull(outDir, "Trainer.resume: outDir");
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

  /** Sequences concatenated, with their lengths, and their labels (null entries: the sequence's ids). */
  private static final class Flat {
    final int[] ids;
    final int[] labels;  // null when no labels were given
    final long[] lengths;

    Flat(List<int[]> sequences, List<int[]> labelList, String what) {
      SeqgradException.notNull(sequences, what + ": sequences");
      if (labelList != null && labelList.size() != sequences.size()) {
        throw new InvalidArgumentException(what + ": labels has " + labelList.size() + " entries but sequences has "
            + sequences.size());
      }
      int total = 0;
      for (int i = 0; i < sequences.size(); ++i) {
        int n = SeqgradException.notNull(sequences.get(i), what + ": sequences[" + i + "]").length;
        int[] l = labelList == null ? null : labelList.get(i);
        if (l != null && l.length != n) {
          throw new InvalidArgumentException(what + ": labels[" + i + "] has " + l.length + " entries but sequences["
              + i + "] has " + n);
        }
        total += n;
      }
      ids = new int[total];
      labels = labelList == null ? null : new int[total];
      lengths = new long[sequences.size()];
      int off = 0;
      for (int i = 0; i < sequences.size(); ++i) {
        int[] s = sequences.get(i);
        System.arraycopy(s, 0, ids, off, s.length);
        if (labels != null) {
          int[] l = labelList.get(i);
          System.arraycopy(l == null ? s : l, 0, labels, off, s.length);
        }
        off += s.length;
        lengths[i] = s.length;
      }
    }

    /** A flat per-token array cut back into the sequences. */
    List<double[]> split(double[] flat) {
      List<double[]> out = new ArrayList<>(lengths.length);
      int off = 0;
      for (long n : lengths) {
        out.add(Arrays.copyOfRange(flat, off, off + (int) n));
        off += (int) n;
      }
      return out;
    }
  }

  /**
   * {@link #step(int[], int[], long[])} of sequences with next-token labels.
   *
   * @param sequences the token ids of each sequence
   * @return the call's metrics
   */
  public Metrics step(List<int[]> sequences) {
    return step(sequences, null);
  }

  /**
   * {@link #step(int[], int[], long[])} of sequences with their labels.
   *
   * @param sequences the token ids of each sequence
   * @param labels each sequence's labels (as in {@link #step(int[], int[], long[])}; a null entry = next-token
   *     labels), or null = next-token labels for all
   * @return the call's metrics
   */
  public Metrics step(List<int[]> sequences, List<int[]> labels) {
    Flat f = new Flat(sequences, labels, "Trainer.step");
    return step(f.ids, f.labels, f.lengths);
  }

  /**
   * Per-token log-probabilities of a batch under this trainer's model, without gradients: entry t of a sequence is
   * the natural log of p(labels[t] | ids[0..t)), NaN at the sequence's position 0 and where the label is -100. The
   * entries are aligned with ids and labels (see {@link Trainer}), as {@link GrpoCompletion}'s oldLogprobs and
   * refLogprobs take them (score with a trainer over the sampling policy, or over the reference model), and a
   * sequence's sum of non-NaN entries is the log-likelihood a {@link DpoPair}'s reference log-prob holds. Computed by
   * the chunked forward pass ({@link Options#chunk}, {@link Options#lmChunk}) at any length, for every model family,
   * in the model's dtype, without dropout; any objective. Gradients, the optimizer and the progress listener are left
   * alone. A batch without any label gives all NaN.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #step(int[], int[], long[])}; null = next-token labels (the log-prob of each id)
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @return ids.length log-probs
   */
  public double[] score(int[] ids, int[] labels, long[] lengths) {
    return score(ids, labels, lengths, null);
  }

  /**
   * {@link #score(int[], int[], long[])} of sequences that pack documents.
   *
   * @param ids as in {@link #step(int[], int[], long[])}
   * @param labels as in {@link #score(int[], int[], long[])}
   * @param lengths as in {@link #step(int[], int[], long[])}
   * @param docLengths as in {@link #step(int[], int[], long[], long[][])}
   * @return ids.length log-probs
   */
  public double[] score(int[] ids, int[] labels, long[] lengths, long[][] docLengths) {
    long h = acquire();
    try {
      return NativeApi.trainerScore(h, ids, labels, lengths, docLengths);
    } finally {
      release();
    }
  }

  /**
   * {@link #score(int[], int[], long[])} of sequences, one array per sequence.
   *
   * @param sequences the token ids of each sequence
   * @param labels as in {@link #step(List, List)}
   * @return each sequence's log-probs, aligned with its ids
   */
  public List<double[]> score(List<int[]> sequences, List<int[]> labels) {
    Flat f = new Flat(sequences, labels, "Trainer.score");
    return f.split(score(f.ids, f.labels, f.lengths));
  }

  private Metrics run(int mode, int[] ids, int[] labels, long[] lengths, long[][] docLengths) {
    long h = acquire();
    try {
      return new Metrics(NativeApi.trainerRun(h, mode, ids, labels, lengths, docLengths));
    } finally {
      release();
    }
  }

  /** Stops the running step (it throws {@link CancelledException}), or the next one. Thread-safe. */
  public void cancel() {
    long h = acquire();  // keeps the handle alive during the call; throws if closed
    try {
      NativeApi.trainerCancel(h);
    } finally {
      release();
    }
  }

  /**
   * Optimizer steps taken.
   *
   * @return the step count
   */
  public long stepCount() {
    long h = acquire();
    try {
      return NativeApi.trainerStepCount(h);
    } finally {
      release();
    }
  }

  /**
   * Receives progress events for the trainer (JNI keeps a global ref to it until the trainer is freed). It refers to
   * the trainer weakly, so that a forgotten trainer can still be collected; during a call the trainer is reachable.
   */
  static final class Holder {
    private volatile WeakReference<Trainer> trainer = new WeakReference<>(null);

    Trainer bind(Trainer t) {
      trainer = new WeakReference<>(t);
      return t;
    }

    void onProgress(long step, double loss, long tokens, double gradNorm, int phase) {
      Trainer t = trainer.get();
      if (t != null) t.onProgress(step, loss, tokens, gradNorm, phase);
    }
  }
}
