package org.seqgrad;

/**
 * The engine does not support the request (e.g. a strategy for this model family or device). Status code {@link
 * SeqgradException#UNIMPLEMENTED}.
 */
public final class UnimplementedException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public UnimplementedException(String message) {
    super(UNIMPLEMENTED, message);
  }
}
