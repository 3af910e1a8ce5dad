package org.seqgrad;

import java.util.Arrays;
import java.util.List;

/**
 * LoRA options ({@link Model#enableLora}), as the C API's sg_lora_options: adapters in Hugging Face PEFT's convention
 * on the linear modules named by {@link #targets}; {@link Model#lora()} returns the model's.
 */
public final class LoraOptions {
  /** r >= 1. */
  public long rank = 8;
  /** lora_alpha: the adapters' output is scaled by alpha / rank; 0 = 2 * rank. */
  public double alpha = 0;
  /** Dropout on the adapters' input in [0, 1), training passes only. */
  public double dropout = 0;
  /**
   * Comma-separated Hugging Face module names or "all"; null = the family's default ("q_proj,v_proj" for transformers,
   * "in_proj,x_proj" for SSMs). Llama/Qwen2: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
   * Mamba: in_proj, x_proj.
   */
  public String targets = null;
  /** Initialisation of the A matrices (all 64 bits, as unsigned). */
  public long seed = 0;

  /** Options with the defaults. */
  public LoraOptions() {}

  // Called from JNI (Model.lora()).
  LoraOptions(long rank, double alpha, double dropout, String targets, long seed) {
    this.rank = rank;
    this.alpha = alpha;
    this.dropout = dropout;
    this.targets = targets;
    this.seed = seed;
  }

  /** Sets {@link #rank}; returns these options. */
  public LoraOptions rank(long r) { rank = r; return this; }
  /** Sets {@link #alpha}; returns these options. */
  public LoraOptions alpha(double a) { alpha = a; return this; }
  /** Sets {@link #dropout}; returns these options. */
  public LoraOptions dropout(double d) { dropout = d; return this; }
  /** Sets {@link #targets}; returns these options. */
  public LoraOptions targets(String t) { targets = t; return this; }
  /** Sets {@link #targets}; returns these options. */
  public LoraOptions targets(List<String> t) { targets = t == null ? null : String.join(",", t); return this; }
  /** Sets {@link #seed}; returns these options. */
  public LoraOptions seed(long s) { seed = s; return this; }

  /** The target module names (empty for null). */
  public List<String> targetList() {
    return targets == null || targets.isEmpty() ? List.of() : Arrays.asList(targets.split(","));
  }

  @Override
  public String toString() {
    return "LoRA r=" + rank + " alpha=" + alpha + " dropout=" + dropout + " targets=" + targets;
  }
}
