package org.seqgrad;

/**
 * The file system refused access to a file the call reads or writes. Status code {@link
 * SeqgradException#PERMISSION_DENIED}.
 */
public final class PermissionDeniedException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public PermissionDeniedException(String message) {
    super(PERMISSION_DENIED, message);
  }
}
