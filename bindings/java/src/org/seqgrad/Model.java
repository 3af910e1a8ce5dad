package org.seqgrad;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;
import java.util.function.IntFunction;

/**
 * A seqgrad model of any family: a transformer (Llama/Qwen2) or a Mamba-1 SSM ({@link #family}). Parameter and
 * gradient buffers are zero-copy direct ByteBuffers over the engine's memory, valid while this model or one of its
 * trainers is open (except that {@link #enableLora} releases the base parameters' gradients: {@link #grad} buffers
 * taken before it must not be used after it). Trainers keep the native model alive.
 */
public final class Model extends NativeHandle {
  private Model(long h) {
    super(h, "Model");
  }

  /** A randomly initialised model from a built-in preset ({@link #presetNames}: "tiny", ..., "tiny-ssm", ...). */
  public static Model fromPreset(String name, String dtype, long seed) {
    return new Model(NativeApi.modelCreatePreset(name, dtype, seed));
  }

  public static Model fromPreset(String name) {
    return fromPreset(name, "f32", 0);
  }

  /** A model from a Hugging Face directory (config.json + safetensors; model_type llama, qwen2 or mamba). */
  public static Model load(String dir, String dtype) {
    return new Model(NativeApi.modelLoad(dir, dtype));
  }

  /** Names of the built-in presets of every family: transformers, then SSMs ("tiny-ssm", "bench-ssm"). */
  public static List<String> presetNames() {
    return names(NativeApi::presetName);
  }

  public static String version() {
    return NativeApi.version();
  }

  /** Names of the engine's memory categories, in the order of {@link Metrics#peakBytesByCategory}. */
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
   */
  public void save(String dir) {
    long h = acquire();
    try {
      NativeApi.modelSave(h, dir);
    } finally {
      release();
    }
  }

  public long vocabSize() {
    long h = acquire();
    try {
      return NativeApi.modelVocabSize(h);
    } finally {
      release();
    }
  }

  /** "transformer" or "ssm". */
  public String family() {
    long h = acquire();
    try {
      return NativeApi.modelFamily(h);
    } finally {
      release();
    }
  }

  public long numLayers() {
    long h = acquire();
    try {
      return NativeApi.modelNumLayers(h);
    } finally {
      release();
    }
  }

  public long hiddenSize() {
    long h = acquire();
    try {
      return NativeApi.modelHiddenSize(h);
    } finally {
      release();
    }
  }

  public int numParams() {
    long h = acquire();
    try {
      return (int) NativeApi.modelNumParams(h);
    } finally {
      release();
    }
  }

  /**
   * Caps the engine memory of this model's tensors (weights included) at {@code bytes}; 0 removes the cap. A step that
   * would need more throws {@link ResourceExhaustedException} and leaves the model usable.
   */
  public void setMemoryLimit(long bytes) {
    long h = acquire();
    try {
      NativeApi.modelSetMemoryLimit(h, bytes);
    } finally {
      release();
    }
  }

  /** The memory limit in bytes (0 = none). */
  public long memoryLimit() {
    long h = acquire();
    try {
      return NativeApi.modelMemoryLimit(h);
    } finally {
      release();
    }
  }

  /**
   * Adds LoRA adapters to the modules named by {@code o.targets} and freezes every base parameter: only the adapters
   * ("&lt;module&gt;.lora_A.weight", ".lora_B.weight", after the base parameters) get gradients and AdamW moments.
   * Once per model, before any trainer of it is created ({@link FailedPreconditionException} otherwise); bad options
   * throw {@link InvalidArgumentException} naming the option.
   */
  public void enableLora(LoraOptions o) {
    long h = acquire();
    try {
      NativeApi.modelEnableLora(h, o.rank, o.alpha, o.dropout, o.targets, o.seed);
    } finally {
      release();
    }
  }

  /** The model's LoRA options (targets as a comma-separated list), or null without LoRA. */
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
   * peft.PeftModel.from_pretrained(base, dir) loads; baseModelNameOrPath (may be null) is recorded in the config.
   */
  public void saveLoraAdapter(String dir, String baseModelNameOrPath) {
    long h = acquire();
    try {
      NativeApi.modelSaveLoraAdapter(h, dir, baseModelNameOrPath);
    } finally {
      release();
    }
  }

  /**
   * Loads a PEFT adapter directory (without LoRA, enables it with the adapter's options first). An adapter of another
   * base model throws {@link InvalidArgumentException} naming the tensor and both shapes; a missing directory {@link
   * NotFoundException}.
   */
  public void loadLoraAdapter(String dir) {
    long h = acquire();
    try {
      NativeApi.modelLoadLoraAdapter(h, dir);
    } finally {
      release();
    }
  }

  public String paramName(int i) {
    long h = acquire();
    try {
      return NativeApi.paramName(h, i);
    } finally {
      release();
    }
  }

  public long[] paramShape(int i) {
    long h = acquire();
    try {
      return NativeApi.paramShape(h, i);
    } finally {
      release();
    }
  }

  public String paramDType(int i) {
    long h = acquire();
    try {
      return NativeApi.paramDType(h, i);
    } finally {
      release();
    }
  }

  /** The parameter's memory (native byte order); writes change the model. */
  public ByteBuffer param(int i) {
    long h = acquire();
    try {
      return NativeApi.paramBuffer(h, i, false).order(ByteOrder.nativeOrder());
    } finally {
      release();
    }
  }

  /** The gradient's memory, or null for a frozen parameter. */
  public ByteBuffer grad(int i) {
    long h = acquire();
    try {
      ByteBuffer b = NativeApi.paramBuffer(h, i, true);
      return b == null ? null : b.order(ByteOrder.nativeOrder());
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

  @Override
  void free(long h) {
    NativeApi.modelFree(h);
  }
}
