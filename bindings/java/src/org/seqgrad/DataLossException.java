package org.seqgrad;

/**
 * Unrecoverable data: a corrupt, truncated or incomplete file such as a checkpoint (the message names the file).
 * Status code {@link SeqgradException#DATA_LOSS}.
 */
public final class DataLossException extends SeqgradException {
  /**
   * An exception with the given message.
   *
   * @param message what failed
   */
  public DataLossException(String message) {
    super(DATA_LOSS, message);
  }
}
