package org.seqgrad;

/**
 * A native handle shared by threads: uses are counted; close() is idempotent, waits for uses in flight and frees
 * the handle once; any use after close throws IllegalStateException.
 */
abstract class NativeHandle implements AutoCloseable {
  private final long handle;
  private int users;
  private boolean closed;
  private final String what;

  NativeHandle(long handle, String what) {
    this.handle = handle;
    this.what = what;
  }

  final synchronized long acquire() {
    if (closed) throw new IllegalStateException(what + " is closed");
    users++;
    return handle;
  }

  final synchronized void release() {
    if (--users == 0) notifyAll();
  }

  /** The handle if still open (no use count), else 0; for calls that must never block or throw. */
  final synchronized long peek() {
    return closed ? 0 : handle;
  }

  public final boolean isClosed() {
    synchronized (this) {
      return closed;
    }
  }

  abstract void free(long handle);

  @Override
  public void close() {
    synchronized (this) {
      if (closed) return;
      closed = true;
      boolean interrupted = false;
      while (users > 0) {
        try {
          wait();
        } catch (InterruptedException e) {
          interrupted = true;
        }
      }
      if (interrupted) Thread.currentThread().interrupt();
    }
    free(handle);
  }
}
