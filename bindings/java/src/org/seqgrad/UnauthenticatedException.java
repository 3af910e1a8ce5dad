package org.seqgrad;

/** The request lacks valid credentials. Status code {@link SeqgradException#UNAUTHENTICATED}. */
public final class UnauthenticatedException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public UnauthenticatedException(String message) {
    super(UNAUTHENTICATED, message);
  }
}
