package org.seqgrad;

/**
 * A file or directory that does not exist, e.g. a missing model or checkpoint directory. Status code {@link
 * SeqgradException#NOT_FOUND}.
 */
public final class NotFoundException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public NotFoundException(String message) {
    super(NOT_FOUND, message);
  }
}
