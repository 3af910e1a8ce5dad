package org.seqgrad;

import java.lang.ref.Cleaner;
import java.lang.ref.Reference;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.LongConsumer;

/**
 * A native handle shared by threads: uses are counted; close() is idempotent, waits for uses in flight and frees
 * the handle once; any use after close throws IllegalStateException. A handle that is never closed is freed by a
 * {@link Cleaner} once its object is unreachable.
 *
 * <p>The JVM does not see native memory: a program that forgets handles fills its heap too slowly for the collector
 * to run, and the native memory would grow without bound. So each handle counts the native bytes it holds (an
 * estimate), and creating one while the bytes of handles not yet freed pass a threshold first collects garbage, which
 * lets the Cleaner free the forgotten ones; the threshold is then twice what stays open (at least 64 MiB).
 */
abstract class NativeHandle implements AutoCloseable {
  /** Frees forgotten handles and releases view buffers (one daemon thread for the library). */
  static final Cleaner CLEANER = Cleaner.create();

  private static final long MIN_COLLECT_BYTES = 64L << 20;
  /** Native bytes of the handles not yet freed. */
  private static final AtomicLong openBytes = new AtomicLong();
  /** openBytes past which a new handle first collects garbage; guarded by NativeHandle.class. */
  private static long collectAt = MIN_COLLECT_BYTES;

  /** What close() and the Cleaner share; it must not refer to the handle object, or that could never be collected. */
  private static final class State implements Runnable {
    final long handle;
    final String what;
    final LongConsumer free;
    final long bytes;
    int users;
    boolean closed;

    State(long handle, String what, LongConsumer free, long bytes) {
      this.handle = handle;
      this.what = what;
      this.free = free;
      this.bytes = bytes;
    }

    /** Runs once: from close(), or from the Cleaner when the object was never closed. */
    @Override
    public void run() {
      free.accept(handle);
      openBytes.addAndGet(-bytes);
    }
  }

  private final State state;
  private final Cleaner.Cleanable cleanable;

  /** A handle holding about {@code bytes} of native memory, freed by {@code free}. */
  NativeHandle(long handle, String what, LongConsumer free, long bytes) {
    state = new State(handle, what, free, bytes);
    cleanable = CLEANER.register(this, state);
    if (openBytes.addAndGet(bytes) > collectAt()) collectForgotten();
  }

  private static synchronized long collectAt() {
    return collectAt;
  }

  /**
   * Collects garbage and waits (at most 100 ms) until the Cleaner has freed half of the open bytes, then sets the
   * threshold to twice what stays open: handles that are in use cost one collection per doubling.
   */
  private static synchronized void collectForgotten() {
    long open = openBytes.get();
    if (open <= collectAt) return;  // another thread just collected
    System.gc();
    try {
      for (int i = 0; i < 50 && openBytes.get() > open / 2; ++i) Thread.sleep(2);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
    collectAt = Math.max(MIN_COLLECT_BYTES, 2 * openBytes.get());
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
