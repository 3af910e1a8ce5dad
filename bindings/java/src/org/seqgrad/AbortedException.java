package org.seqgrad;

/** The operation was aborted. Status code {@link SeqgradException#ABORTED}. */
public final class AbortedException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public AbortedException(String message) {
    super(ABORTED, message);
  }
}
