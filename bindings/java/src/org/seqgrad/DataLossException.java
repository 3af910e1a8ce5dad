package org.seqgrad;

/** Unrecoverable data (code DATA_LOSS): a corrupt, truncated or incomplete checkpoint; the message names the file. */
public final class DataLossException extends SeqgradException {
  public DataLossException(String message) {
    super(DATA_LOSS, message);
  }
}
