package org.seqgrad;

/** What a loaded checkpoint restored: its optimizer step and the caller's data position saved with it. */
public final class CheckpointState {
  /** The optimizer step the checkpoint was saved at. */
  public final long step;
  /** The caller's data position saved with it. */
  public final long dataPosition;

  CheckpointState(long step, long dataPosition) {
    this.step = step;
    this.dataPosition = dataPosition;
  }

  @Override
  public String toString() {
    return "step " + step + " data position " + dataPosition;
  }
}
