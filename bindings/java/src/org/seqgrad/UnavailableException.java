package org.seqgrad;

/** A resource is temporarily unavailable. Status code {@link SeqgradException#UNAVAILABLE}. */
public final class UnavailableException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public UnavailableException(String message) {
    super(UNAVAILABLE, message);
  }
}
