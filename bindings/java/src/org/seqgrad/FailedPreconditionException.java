package org.seqgrad;

/**
 * The call does not fit the object's state, e.g. {@link Trainer#stepDpo} on a trainer whose objective is not "dpo", or
 * a checkpoint of another run configuration. Status code {@link SeqgradException#FAILED_PRECONDITION}.
 */
public final class FailedPreconditionException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public FailedPreconditionException(String message) {
    super(FAILED_PRECONDITION, message);
  }
}
