package org.seqgrad;

/**
 * A failed seqgrad status. {@link #getCode()} is the C API's sg_code (absl's codes, plus {@link #BUSY} = 100); every
 * code has its subclass ({@link InvalidArgumentException}, {@link BusyException}, ...; see {@link #of}), so callers
 * can catch the one they handle.
 */
public class SeqgradException extends RuntimeException {
  /** Stopped by {@link Trainer#cancel()}: {@link CancelledException}. */
  public static final int CANCELLED = 1;
  /** {@link UnknownException}. */
  public static final int UNKNOWN = 2;
  /** {@link InvalidArgumentException}. */
  public static final int INVALID_ARGUMENT = 3;
  /** {@link DeadlineExceededException}. */
  public static final int DEADLINE_EXCEEDED = 4;
  /** {@link NotFoundException}. */
  public static final int NOT_FOUND = 5;
  /** {@link AlreadyExistsException}. */
  public static final int ALREADY_EXISTS = 6;
  /** {@link PermissionDeniedException}. */
  public static final int PERMISSION_DENIED = 7;
  /** {@link ResourceExhaustedException}. */
  public static final int RESOURCE_EXHAUSTED = 8;
  /** {@link FailedPreconditionException}. */
  public static final int FAILED_PRECONDITION = 9;
  /** {@link AbortedException}. */
  public static final int ABORTED = 10;
  /** {@link OutOfRangeException}. */
  public static final int OUT_OF_RANGE = 11;
  /** {@link UnimplementedException}. */
  public static final int UNIMPLEMENTED = 12;
  /** {@link InternalException}: e.g. a NaN/Inf loss or gradient (the message names the step and the tensor). */
  public static final int INTERNAL = 13;
  /** {@link UnavailableException}. */
  public static final int UNAVAILABLE = 14;
  /** {@link DataLossException}. */
  public static final int DATA_LOSS = 15;
  /** {@link UnauthenticatedException}. */
  public static final int UNAUTHENTICATED = 16;
  /** The trainer or model is in use by another thread: {@link BusyException}. */
  public static final int BUSY = 100;

  /** Names of the codes 0..16, as the C API's sg_code_name. */
  private static final String[] NAMES = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
      "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};

  /** The status code. */
  private final int code;

  /**
   * An exception of any code; {@link #of} gives the typed subclass instead.
   *
   * @param code the status code
   * @param message what failed
   */
  public SeqgradException(int code, String message) {
    super(message);
    this.code = code;
  }

  /**
   * The exception of a failed status: the subclass for its code, or SeqgradException itself for a code the C API does
   * not define.
   *
   * @param code the status code
   * @param message the status message
   * @return the exception (not thrown)
   */
  public static SeqgradException of(int code, String message) {
    switch (code) {
      case CANCELLED: return new CancelledException(message);
      case UNKNOWN: return new UnknownException(message);
      case INVALID_ARGUMENT: return new InvalidArgumentException(message);
      case DEADLINE_EXCEEDED: return new DeadlineExceededException(message);
      case NOT_FOUND: return new NotFoundException(message);
      case ALREADY_EXISTS: return new AlreadyExistsException(message);
      case PERMISSION_DENIED: return new PermissionDeniedException(message);
      case RESOURCE_EXHAUSTED: return new ResourceExhaustedException(message);
      case FAILED_PRECONDITION: return new FailedPreconditionException(message);
      case ABORTED: return new AbortedException(message);
      case OUT_OF_RANGE: return new OutOfRangeException(message);
      case UNIMPLEMENTED: return new UnimplementedException(message);
      case INTERNAL: return new InternalException(message);
      case UNAVAILABLE: return new UnavailableException(message);
      case DATA_LOSS: return new DataLossException(message);
      case UNAUTHENTICATED: return new UnauthenticatedException(message);
      case BUSY: return new BusyException(message);
      default: return new SeqgradException(code, message);
    }
  }

  /**
   * The status code.
   *
   * @return one of the constants of this class
   */
  public int getCode() {
    return code;
  }

  /**
   * The code's name, as the C API's sg_code_name.
   *
   * @return e.g. "INVALID_ARGUMENT"; "CODE_&lt;n&gt;" for a code the C API does not define
   */
  public String getCodeName() {
    if (code == BUSY) return "BUSY";
    return code >= 0 && code < NAMES.length ? NAMES[code] : "CODE_" + code;
  }

  /**
   * Checks a required argument before it reaches the native library.
   *
   * @param value the argument
   * @param what the call and the argument's name, e.g. "Trainer.create: model"
   * @param <T> its type
   * @return value
   * @throws InvalidArgumentException "&lt;what&gt; is null" when value is null
   */
  static <T> T notNull(T value, String what) {
    if (value == null) throw new InvalidArgumentException(what + " is null");
    return value;
  }
}
