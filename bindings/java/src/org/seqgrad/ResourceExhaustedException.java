package org.seqgrad;

/**
 * Out of memory, or a step would pass the model's memory limit ({@link Model#setMemoryLimit}) (code
 * RESOURCE_EXHAUSTED). The model and its trainers stay usable.
 */
public final class ResourceExhaustedException extends SeqgradException {
  public ResourceExhaustedException(String message) {
    super(RESOURCE_EXHAUSTED, message);
  }
}
