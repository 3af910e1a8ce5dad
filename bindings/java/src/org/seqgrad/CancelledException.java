package org.seqgrad;

/** The call was stopped by {@link Trainer#cancel()}. Status code {@link SeqgradException#CANCELLED}. */
public final class CancelledException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public CancelledException(String message) {
    super(CANCELLED, message);
  }
}
