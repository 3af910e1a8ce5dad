package org.seqgrad;

/** Something the call would create exists already. Status code {@link SeqgradException#ALREADY_EXISTS}. */
public final class AlreadyExistsException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public AlreadyExistsException(String message) {
    super(ALREADY_EXISTS, message);
  }
}
