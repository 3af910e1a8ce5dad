package org.seqgrad;

/**
 * Another thread is running a step on this trainer, on another trainer of the same model or on its reference model
 * (seqgrad's own code, 100). Status code {@link SeqgradException#BUSY}.
 */
public final class BusyException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public BusyException(String message) {
    super(BUSY, message);
  }
}
