package org.seqgrad;

/** A bad argument (code INVALID_ARGUMENT); the message names it. */
public final class InvalidArgumentException extends SeqgradException {
  public InvalidArgumentException(String message) {
    super(INVALID_ARGUMENT, message);
  }
}
