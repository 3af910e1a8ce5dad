package org.seqgrad;

/**
 * A failed seqgrad status: {@link #getCode()} is the C API's sg_code (absl codes; 100 = BUSY). Some codes have a
 * subclass: {@link InvalidArgumentException}, {@link ResourceExhaustedException},
 * {@link FailedPreconditionException}, {@link NotFoundException}, {@link DataLossException}.
 */
public class SeqgradException extends RuntimeException {
  public static final int CANCELLED = 1;
  public static final int UNKNOWN = 2;
  public static final int INVALID_ARGUMENT = 3;
  public static final int NOT_FOUND = 5;
  public static final int PERMISSION_DENIED = 7;
  public static final int RESOURCE_EXHAUSTED = 8;
  public static final int FAILED_PRECONDITION = 9;
  public static final int OUT_OF_RANGE = 11;
  public static final int UNIMPLEMENTED = 12;
  /** An internal failure, e.g. a NaN/Inf loss or gradient (the message names the step and the tensor). */
  public static final int INTERNAL = 13;
  public static final int DATA_LOSS = 15;
  public static final int BUSY = 100;

  private final int code;

  public SeqgradException(int code, String message) {
    super(message);
    this.code = code;
  }

  public int getCode() {
    return code;
  }

  public String getCodeName() {
    switch (code) {
      case CANCELLED: return "CANCELLED";
      case INVALID_ARGUMENT: return "INVALID_ARGUMENT";
      case NOT_FOUND: return "NOT_FOUND";
      case PERMISSION_DENIED: return "PERMISSION_DENIED";
      case UNIMPLEMENTED: return "UNIMPLEMENTED";
      case DATA_LOSS: return "DATA_LOSS";
      case RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
      case FAILED_PRECONDITION: return "FAILED_PRECONDITION";
      case OUT_OF_RANGE: return "OUT_OF_RANGE";
      case INTERNAL: return "INTERNAL";
      case BUSY: return "BUSY";
      default: return "CODE_" + code;
    }
  }
}
