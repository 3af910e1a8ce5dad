package org.seqgrad;

/** Something named does not exist (code NOT_FOUND), e.g. no checkpoint to resume from, a missing directory. */
public final class NotFoundException extends SeqgradException {
  public NotFoundException(String message) {
    super(NOT_FOUND, message);
  }
}
