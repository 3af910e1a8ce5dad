package org.seqgrad;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;
import java.util.function.IntFunction;

/**
 * A seqgrad model of any family: a transformer (Llama/Qwen2) or a Mamba-1 SSM ({@link #family}).
 *
 * <p>Close it when done ({@link AutoCloseable}); a model that is never closed is freed once it is unreachable. Its
 * trainers keep the native model alive, so closing the model while a trainer runs is safe.
 *
 * <p>Views: {@link #param} and {@link #grad} are zero-copy direct ByteBuffers over the engine's memory. Each view (and
 * every slice, duplicate or {@code asFloatBuffer()} of it) keeps the model's native memory alive until the view is
 * garbage-collected, even after {@link #close}: a view never reads or writes freed memory. Enabling LoRA releases the
 * base parameters' gradients, so {@link #enableLora} (and {@link #loadLoraAdapter} on a model without LoRA) throws
 * {@link FailedPreconditionException} while gradient views of the model are still reachable: enable LoRA before
 * taking gradient views.
 *
 * <p>Devices: a model created or loaded with device "cuda" lives in GPU memory, which is not host memory. Its
 * {@link #param} and {@link #grad} are then copies (direct buffers the model does not see): write parameters with
 * {@link #setParam}.
 */
public final class Model extends NativeHandle {
  private Model(long h) {
    super(h, "Model", NativeApi::modelFree, 2 * NativeApi.modelParamBytes(h));  // values and gradients
  }

  /**
   * A randomly initialised model from a built-in preset.
   *
   * @param name a preset of {@link #presetNames}: "tiny", ..., "tiny-ssm", ...
   * @param dtype "f32" or "f64"; null = "f32"; or "bf16" (CPU; Llama/Qwen2/Qwen3: bf16 weight matrices, KV pages and
   *     logits; Mamba: bf16 linear and embedding matrices and logits; f32 compute)
   * @param seed initialisation seed (all 64 bits, as unsigned)
   * @return the model
   * @throws InvalidArgumentException for a null name, an unknown preset or dtype
   */
  public static Model fromPreset(String name, String dtype, long seed) {
    return fromPreset(name, dtype, seed, null);
  }

  /**
   * A randomly initialised model from a built-in preset on a device.
   *
   * @param name a preset of {@link #presetNames}
   * @param dtype "f32", "f64" or "bf16"; null = "f32"
   * @param seed initialisation seed (all 64 bits, as unsigned)
   * @param device "cpu" or "cuda"; null = "cpu". On "cuda" the views are copies (see the class comment)
   * @return the model
   * @throws InvalidArgumentException for a null name, an unknown preset, dtype or device
   * @throws FailedPreconditionException for "cuda" without a usable GPU (or a library built without CUDA)
   */
  public static Model fromPreset(String name, String dtype, long seed, String device) {
    return fromPreset(name, dtype, seed, device, false);
  }

  /**
   * A preset created with a frozen base: no parameter gets a gradient and none is allocated, for LoRA (enabled next:
   * only the adapters train) or a model that only scores. A step on it without LoRA throws
   * FailedPreconditionException.
   *
   * @param name a preset of {@link #presetNames}
   * @param dtype "f32", "f64" or "bf16"; null = "f32"
   * @param seed initialisation seed (all 64 bits, as unsigned)
   * @param device "cpu" or "cuda"; null = "cpu"
   * @param frozenBase true: the base parameters have no gradients
   * @return the model
   */
  public static Model fromPreset(String name, String dtype, long seed, String device, boolean frozenBase) {
    SeqgradException.notNull(name, "Model.fromPreset: name");
    return new Model(NativeApi.modelCreatePreset(name, dtype, seed, device, frozenBase));
  }

  /**
   * A preset in f32 with seed 0.
   *
   * @param name a preset of {@link #presetNames}
   * @return the model
   */
  public static Model fromPreset(String name) {
    return fromPreset(name, "f32", 0);
  }

  /**
   * A model from a Hugging Face directory (config.json + safetensors; model_type llama, qwen2 or mamba).
   *
   * @param dir the directory
   * @param dtype "f32" or "f64"; null = "f32"; or "bf16" (CPU; Llama/Qwen2/Qwen3: bf16 weight matrices, KV pages and
   *     logits; Mamba: bf16 linear and embedding matrices and logits; f32 compute)
   * @return the model
   * @throws NotFoundException when the directory or its files do not exist
   * @throws InvalidArgumentException for a null dir or an unsupported config
   */
  public static Model load(String dir, String dtype) {
    return load(dir, dtype, null);
  }

  /**
   * A model from a Hugging Face directory on a device.
   *
   * @param dir the directory
   * @param dtype "f32", "f64" or "bf16"; null = "f32"
   * @param device "cpu" or "cuda"; null = "cpu". On "cuda" the views are copies (see the class comment)
   * @return the model
   * @throws NotFoundException when the directory or its files do not exist
   * @throws InvalidArgumentException for a null dir, an unsupported config or an unknown device
   * @throws FailedPreconditionException for "cuda" without a usable GPU (or a library built without CUDA)
   */
  public static Model load(String dir, String dtype, String device) {
    return load(dir, dtype, device, false);
  }

  /**
   * A model from a Hugging Face directory with a frozen base (see {@link #fromPreset(String, String, long, String,
   * boolean)}).
   *
   * @param dir the directory
   * @param dtype "f32", "f64" or "bf16"; null = "f32"
   * @param device "cpu" or "cuda"; null = "cpu"
   * @param frozenBase true: the base parameters have no gradients
   * @return the model
   */
  public static Model load(String dir, String dtype, String device, boolean frozenBase) {
    SeqgradException.notNull(dir, "Model.load: dir");
    return new Model(NativeApi.modelLoad(dir, dtype, device, frozenBase));
  }

  /**
   * Where the model lives.
   *
   * @return "cpu" or "cuda"
   */
  public String device() {
    long h = acquire();
    try {
      return NativeApi.modelDevice(h);
    } finally {
      release();
    }
  }

  /**
   * Writes a parameter's values (any device).
   *
   * @param i index in [0, {@link #numParams})
   * @param values exactly the parameter's bytes, in native byte order, from position 0 to the limit
   * @throws InvalidArgumentException when the size differs
   * @throws OutOfRangeException for a bad index
   */
  public void setParam(int i, ByteBuffer values) {
    SeqgradException.notNull(values, "Model.setParam: values");
    ByteBuffer direct = ByteBuffer.allocateDirect(values.remaining());
    direct.put(values.duplicate());
    long h = acquire();
    try {
      NativeApi.paramWrite(h, i, direct);
    } finally {
      release();
    }
  }

  /**
   * Names of the built-in presets of every family: transformers, then SSMs ("tiny-ssm", "bench-ssm").
   *
   * @return the names
   */
  public static List<String> presetNames() {
    return names(NativeApi::presetName);
  }

  /**
   * The version of the loaded native library, "MAJOR.MINOR.PATCH" (the jar's own is {@link Version#STRING}).
   *
   * @return the version
   */
  public static String version() {
    return NativeApi.version();
  }

  /**
   * Names of the engine's memory categories, in the order of {@link Metrics#peakBytesByCategory}.
   *
   * @return the names
   */
  public static List<String> memoryCategories() {
    return names(NativeApi::memoryCategoryName);
  }

  /** name(0), name(1), ... up to the first null. */
  private static List<String> names(IntFunction<String> name) {
    List<String> out = new ArrayList<>();
    for (int i = 0; ; ++i) {
      String n = name.apply(i);
      if (n == null) return out;
      out.add(n);
    }
  }

  /**
   * Writes config.json + model.safetensors that Hugging Face transformers loads; with LoRA, the merged weights
   * W + (alpha / rank) B A (a plain model without adapters; {@link #saveLoraAdapter} writes the adapters).
   *
   * @param dir the output directory (created if missing)
   */
  public void save(String dir) {
    save(dir, null);
  }

  /**
   * {@link #save(String)} with the weights in a chosen dtype.
   *
   * @param dir the output directory (created if missing)
   * @param dtype null: as the model stores them (a "bf16" model: bf16 weight matrices, f32 norms and biases, labelled
   *     bfloat16); "f32": every tensor in f32; "bf16": only for a "bf16" model
   * @throws InvalidArgumentException for another dtype, or "bf16" for an f32/f64 model
   */
  public void save(String dir, String dtype) {
    SeqgradException.notNull(dir, "Model.save: dir");
    long h = acquire();
    try {
      NativeApi.modelSave(h, dir, dtype);
    } finally {
      release();
    }
  }

  /**
   * The vocabulary size.
   *
   * @return token ids are in [0, vocabSize)
   */
  public long vocabSize() {
    long h = acquire();
    try {
      return NativeApi.modelVocabSize(h);
    } finally {
      release();
    }
  }

  /**
   * The model family.
   *
   * @return "transformer" or "ssm"
   */
  public String family() {
    long h = acquire();
    try {
      return NativeApi.modelFamily(h);
    } finally {
      release();
    }
  }

  /**
   * The number of layers.
   *
   * @return layers
   */
  public long numLayers() {
    long h = acquire();
    try {
      return NativeApi.modelNumLayers(h);
    } finally {
      release();
    }
  }

  /**
   * The hidden size (d_model).
   *
   * @return hidden size
   */
  public long hiddenSize() {
    long h = acquire();
    try {
      return NativeApi.modelHiddenSize(h);
    } finally {
      release();
    }
  }

  /**
   * The number of parameter tensors (LoRA adapters included, after the base parameters).
   *
   * @return tensors; indices of {@link #param} are in [0, numParams)
   */
  public int numParams() {
    long h = acquire();
    try {
      return (int) NativeApi.modelNumParams(h);
    } finally {
      release();
    }
  }

  /**
   * Caps the engine memory of this model's tensors (weights included); a step that would need more throws {@link
   * ResourceExhaustedException} and leaves the model usable.
   *
   * @param bytes the cap; 0 removes it
   */
  public void setMemoryLimit(long bytes) {
    long h = acquire();
    try {
      NativeApi.modelSetMemoryLimit(h, bytes);
    } finally {
      release();
    }
  }

  /**
   * The memory limit.
   *
   * @return bytes; 0 = none
   */
  public long memoryLimit() {
    long h = acquire();
    try {
      return NativeApi.modelMemoryLimit(h);
    } finally {
      release();
    }
  }

  /**
   * Adds LoRA adapters to the modules named by {@code options.targets} and freezes every base parameter: only the
   * adapters ("&lt;module&gt;.lora_A.weight", ".lora_B.weight", after the base parameters) get gradients and AdamW
   * moments. Once per model, before any trainer of it is created and before taking {@link #grad} views (it releases
   * the base parameters' gradients).
   *
   * @param options the adapters' options
   * @throws FailedPreconditionException when LoRA is already enabled, a trainer exists, or gradient views of this
   *     model are still reachable
   * @throws InvalidArgumentException for bad options (the message names the option)
   */
  public void enableLora(LoraOptions options) {
    SeqgradException.notNull(options, "Model.enableLora: options");
    long h = acquire();
    try {
      collectDroppedGradViews(h);
      NativeApi.modelEnableLora(h, options.rank, options.alpha, options.dropout, options.targets, options.seed);
    } finally {
      release();
    }
  }

  /**
   * Gradient views the program has dropped still count until the Cleaner has run: give the garbage collector a few
   * chances (as java.nio does before failing to reserve direct memory). The native call refuses if any view is left.
   */
  private static void collectDroppedGradViews(long h) {
    for (int attempt = 0; attempt < 10 && NativeApi.gradViews(h) > 0; ++attempt) {
      System.gc();
      try {
        Thread.sleep(10);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        return;
      }
    }
  }

  /**
   * The model's LoRA options.
   *
   * @return the options (targets as a comma-separated list), or null without LoRA
   */
  public LoraOptions lora() {
    long h = acquire();
    try {
      return NativeApi.modelLora(h);
    } finally {
      release();
    }
  }

  /**
   * Writes the adapters as Hugging Face PEFT files (adapter_config.json + adapter_model.safetensors) that
   * peft.PeftModel.from_pretrained(base, dir) loads.
   *
   * @param dir the output directory
   * @param baseModelNameOrPath recorded in the config; may be null
   */
  public void saveLoraAdapter(String dir, String baseModelNameOrPath) {
    SeqgradException.notNull(dir, "Model.saveLoraAdapter: dir");
    long h = acquire();
    try {
      NativeApi.modelSaveLoraAdapter(h, dir, baseModelNameOrPath);
    } finally {
      release();
    }
  }

  /**
   * Loads a PEFT adapter directory (without LoRA, enables it with the adapter's options first, see {@link
   * #enableLora}).
   *
   * @param dir the adapter directory
   * @throws InvalidArgumentException for an adapter of another base model (naming the tensor and both shapes)
   * @throws NotFoundException for a missing directory
   */
  public void loadLoraAdapter(String dir) {
    SeqgradException.notNull(dir, "Model.loadLoraAdapter: dir");
    long h = acquire();
    try {
      collectDroppedGradViews(h);
      NativeApi.modelLoadLoraAdapter(h, dir);
    } finally {
      release();
    }
  }

  /**
   * A parameter's Hugging Face name.
   *
   * @param i index in [0, {@link #numParams})
   * @return e.g. "model.embed_tokens.weight"
   * @throws OutOfRangeException for a bad index
   */
  public String paramName(int i) {
    long h = acquire();
    try {
      return NativeApi.paramName(h, i);
    } finally {
      release();
    }
  }

  /**
   * A parameter's shape.
   *
   * @param i index in [0, {@link #numParams})
   * @return the dimensions, row-major
   * @throws OutOfRangeException for a bad index
   */
  public long[] paramShape(int i) {
    long h = acquire();
    try {
      return NativeApi.paramShape(h, i);
    } finally {
      release();
    }
  }

  /**
   * A parameter's element type.
   *
   * @param i index in [0, {@link #numParams})
   * @return "f32" or "f64", or "bf16" for the weight matrices of a "bf16" model (their {@link #grad} is f32)
   * @throws OutOfRangeException for a bad index
   */
  public String paramDType(int i) {
    long h = acquire();
    try {
      return NativeApi.paramDType(h, i);
    } finally {
      release();
    }
  }

  /**
   * The parameter's memory; writes change the model. The view keeps the model's memory alive (see the class comment).
   * On a "cuda" model: a copy of the values, which writes do not reach.
   *
   * @param i index in [0, {@link #numParams})
   * @return a direct buffer in native byte order
   * @throws OutOfRangeException for a bad index
   */
  public ByteBuffer param(int i) {
    return view(i, false);
  }

  /**
   * The gradient's memory (as left by the last gradient call). The view keeps the model's memory alive (see the class
   * comment).
   *
   * @param i index in [0, {@link #numParams})
   * @return a direct buffer in native byte order, or null for a frozen parameter
   * @throws OutOfRangeException for a bad index
   */
  public ByteBuffer grad(int i) {
    return view(i, true);
  }

  private ByteBuffer view(int i, boolean grad) {
    long h = acquire();
    try {
      if (NativeApi.paramOnDevice(h, i)) {  // device memory is not host memory: a copy
        int bytes = Math.toIntExact(NativeApi.paramBytes(h, i, grad));
        ByteBuffer copy = ByteBuffer.allocateDirect(bytes).order(ByteOrder.nativeOrder());
        return NativeApi.paramRead(h, i, grad, copy) ? copy : null;
      }
      ByteBuffer b = NativeApi.paramBuffer(h, i, grad);
      if (b == null) return null;
      // The buffer holds a native reference to the model (paramBuffer); derived buffers keep b reachable.
      CLEANER.register(b, () -> NativeApi.viewRelease(h, grad));
      return b.order(ByteOrder.nativeOrder());
    } finally {
      release();
    }
  }

  /** The handle for a trainer's use (counted: pair with {@link #releaseForTrainer()}). */
  long handleForTrainer() {
    return acquire();
  }

  void releaseForTrainer() {
    release();
  }
}
