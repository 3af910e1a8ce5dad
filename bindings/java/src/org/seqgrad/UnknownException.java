package org.seqgrad;

/** A failure the engine could not classify. Status code {@link SeqgradException#UNKNOWN}. */
public final class UnknownException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public UnknownException(String message) {
    super(UNKNOWN, message);
  }
}
