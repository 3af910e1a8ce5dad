package org.seqgrad;

/**
 * Out of memory, or a step would pass the model's memory limit ({@link Model#setMemoryLimit}). The model and its
 * trainers stay usable. Status code {@link SeqgradException#RESOURCE_EXHAUSTED}.
 */
public final class ResourceExhaustedException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public ResourceExhaustedException(String message) {
    super(RESOURCE_EXHAUSTED, message);
  }
}
