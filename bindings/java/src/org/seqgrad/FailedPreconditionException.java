package org.seqgrad;

/** The call does not fit the object's state, e.g. stepDpo on a trainer whose objective is not "dpo". */
public final class FailedPreconditionException extends SeqgradException {
  public FailedPreconditionException(String message) {
    super(FAILED_PRECONDITION, message);
  }
}
