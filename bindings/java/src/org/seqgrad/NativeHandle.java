package org.seqgrad;

import java.lang.ref.Cleaner;
import java.lang.ref.Reference;
import java.util.function.LongConsumer;

/**
 * A native handle shared by threads: uses are counted; close() is idempotent, waits for uses in flight and frees
 * the handle once; any use after close throws IllegalStateException. A handle that is never closed is freed by a
 * {@link Cleaner} once its object is unreachable.
 */
abstract class NativeHandle implements AutoCloseable {
  /** Frees forgotten handles and releases view buffers (one daemon thread for the library). */
  static final Cleaner CLEANER = Cleaner.create();

  /** What close() and the Cleaner share; it must not refer to the handle object, or that could never be collected. */
  private static final class State implements Runnable {
    final long handle;
    final String what;
    final LongConsumer free;
    int users;
    boolean closed;

    State(long handle, String what, LongConsumer free) {
      this.handle = handle;
      this.what = what;
      this.free = free;
    }

    /** Runs once: from close(), or from the Cleaner when the object was never closed. */
    @Override
    public void run() {
      free.accept(handle);
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;

  NativeHandle(long handle, String what, LongConsumer free) {
    state = new State(handle, what, free);
    cleanable = CLEANER.register(this, state);
  }

  final long acquire() {
    synchronized (state) {
      if (state.closed) throw new IllegalStateException(state.what + " is closed");
      state.users++;
      return state.handle;
    }
  }

  final void release() {
    synchronized (state) {
      if (--state.users == 0) state.notifyAll();
    }
    // The object stays reachable until the native call that used its handle is over (else the Cleaner could free it).
    Reference.reachabilityFence(this);
  }

  /**
   * Whether {@link #close} was called.
   *
   * @return true once closed
   */
  public final boolean isClosed() {
    synchronized (state) {
      return state.closed;
    }
  }

  /** Frees the native object (waiting for calls in flight on other threads); later calls are no-ops. */
  @Override
  public void close() {
    synchronized (state) {
      if (state.closed) return;
      state.closed = true;
      boolean interrupted = false;
      while (state.users > 0) {
        try {
          state.wait();
        } catch (InterruptedException e) {
          interrupted = true;
        }
      }
      if (interrupted) Thread.currentThread().interrupt();
    }
    cleanable.clean();
  }
}
