package org.seqgrad;

/** A bad argument or option; the message names it. Status code {@link SeqgradException#INVALID_ARGUMENT}. */
public final class InvalidArgumentException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public InvalidArgumentException(String message) {
    super(INVALID_ARGUMENT, message);
  }
}
