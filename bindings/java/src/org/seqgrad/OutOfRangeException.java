package org.seqgrad;

/**
 * An index past the end, e.g. a parameter index at or past {@link Model#numParams()}. Status code {@link
 * SeqgradException#OUT_OF_RANGE}.
 */
public final class OutOfRangeException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public OutOfRangeException(String message) {
    super(OUT_OF_RANGE, message);
  }
}
