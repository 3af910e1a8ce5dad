package org.seqgrad;

/**
 * The progress listener threw during a trainer call that then completed: its update is in place (the optimizer step,
 * the accumulated micro-batch or the gradients), so retrying the call would apply the batch twice. {@link #getCause()}
 * is what the listener threw, {@link #getStep()} the trainer's step count after the call. Not a {@link
 * SeqgradException}: the engine did not fail. A listener exception in a call that failed is rethrown as it is.
 */
public final class StepAppliedException extends RuntimeException {
  private final long step;

  /**
   * An exception for a completed call.
   *
   * @param step the trainer's step count after the call
   * @param cause what the listener threw
   */
  public StepAppliedException(long step, Throwable cause) {
    super("the call completed (step count " + step + "; do not retry it) but the progress listener threw: " + cause,
        cause);
    this.step = step;
  }

  /**
   * The trainer's optimizer step count after the call.
   *
   * @return the step count
   */
  public long getStep() {
    return step;
  }
}
