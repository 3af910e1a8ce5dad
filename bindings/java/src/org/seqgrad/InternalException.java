package org.seqgrad;

/**
 * An internal failure, e.g. a NaN/Inf loss or gradient (the message names the step and the tensor). Status code {@link
 * SeqgradException#INTERNAL}.
 */
public final class InternalException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public InternalException(String message) {
    super(INTERNAL, message);
  }
}
