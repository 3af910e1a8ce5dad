package org.seqgrad;

/** A deadline passed before the call finished. Status code {@link SeqgradException#DEADLINE_EXCEEDED}. */
public final class DeadlineExceededException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public DeadlineExceededException(String message) {
    super(DEADLINE_EXCEEDED, message);
  }
}
