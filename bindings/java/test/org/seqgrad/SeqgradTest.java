package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.Test;

class SeqgradTest {
  static int[] seq(int n, int mul, int add, int mod) {
    int[] s = new int[n];
    for (int i = 0; i < n; ++i) s[i] = (i * mul + add) % mod;
    return s;
  }

  static final int[] A = seq(24, 7, 3, 50);
  static final int[] B = seq(16, 5, 1, 50);

  @Test
  void loadsFromJarAndTrains() throws Exception {
    assertEquals("0.1.0", Model.version());
    assertEquals("weights", Model.memoryCategories().get(0));
    try (Model m = Model.fromPreset("tiny", "f32", 1);
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8).lr(3e-3))) {
      int[] events = new int[1];
      t.setProgressListener((step, loss, tokens, gn, phase) -> events[0]++);
      double first = 0, last = 0;
      for (int i = 0; i < 4; ++i) {
        Metrics r = t.step(List.of(A, B));
        if (i == 0) first = r.loss;
        last = r.loss;
        assertEquals(23 + 15, r.tokens);
        assertTrue(r.peakBytes > 0);
      }
      assertTrue(last < first, "loss went down: " + first + " -> " + last);
      assertEquals(8, events[0]);
      assertEquals(4, t.stepCount());

      // Zero-copy views.
      assertEquals("model.embed_tokens.weight", m.paramName(0));
      assertEquals(97, m.paramShape(0)[0]);
      assertEquals("f32", m.paramDType(0));
      FloatBuffer w = m.param(0).asFloatBuffer();
      assertEquals(97 * 32, w.capacity());
      float before = w.get(5);
      m.param(0).asFloatBuffer().put(5, before + 1.0f);
      assertEquals(before + 1.0f, w.get(5));
      assertNotNull(m.grad(0));

      Path dir = Files.createTempDirectory("seqgrad-java");
      m.save(dir.resolve("saved").toString());
      try (Model loaded = Model.load(dir.resolve("saved").toString(), "f32")) {
        assertEquals(m.numParams(), loaded.numParams());
        assertEquals(before + 1.0f, loaded.param(0).asFloatBuffer().get(5));
      }
    }
  }

  @Test
  void errorsAreTypedWithCodes() {
    SeqgradException e = assertThrows(SeqgradException.class, () -> Model.fromPreset("tiny", "f8", 0));
    assertEquals(SeqgradException.INVALID_ARGUMENT, e.getCode());
    assertTrue(e.getMessage().contains("dtype"), e.getMessage());
    assertEquals(SeqgradException.INVALID_ARGUMENT,
        assertThrows(SeqgradException.class, () -> Model.fromPreset(null, "f32", 0)).getCode());
    assertEquals(SeqgradException.NOT_FOUND,
        assertThrows(SeqgradException.class, () -> Model.load("/nonexistent", "f32")).getCode());
    try (Model m = Model.fromPreset("tiny")) {
      assertThrows(SeqgradException.class, () -> Trainer.create(m, new Trainer.Options().strategy("magic")));
      assertEquals(SeqgradException.OUT_OF_RANGE,
          assertThrows(SeqgradException.class, () -> m.paramName(100000)).getCode());
      try (Trainer t = Trainer.create(m, new Trainer.Options())) {
        SeqgradException r = assertThrows(SeqgradException.class,
            () -> t.step(new int[] {1, 2, 97}, null, new long[] {3}));
        assertTrue(r.getMessage().contains("ids[2] = 97"), r.getMessage());
        r = assertThrows(SeqgradException.class, () -> t.step(new int[] {1, 2, 3}, new int[] {1, -5, 2},
            new long[] {3}));
        assertTrue(r.getMessage().contains("labels[1]"), r.getMessage());
        r = assertThrows(SeqgradException.class, () -> t.step(new int[] {1, 2, 3}, null, new long[] {2, 2}));
        assertTrue(r.getMessage().contains("lengths"), r.getMessage());
        r = assertThrows(SeqgradException.class, () -> t.step(new int[] {1, 2, 3}, null, new long[] {}));
        assertTrue(r.getMessage().contains("num_sequences"), r.getMessage());
        r = assertThrows(SeqgradException.class, () -> t.step(null, null, new long[] {3}));
        assertTrue(r.getMessage().contains("'ids'"), r.getMessage());
        r = assertThrows(SeqgradException.class, () -> t.step(new int[] {1, 2, 3}, new int[] {1}, new long[] {3}));
        assertEquals(SeqgradException.INVALID_ARGUMENT, r.getCode());
        t.step(new int[] {1, 2, 3}, null, new long[] {3});
      }
    }
  }

  @Test
  void closeIsIdempotentAndUseAfterCloseThrows() {
    Model m = Model.fromPreset("tiny");
    Trainer t = Trainer.create(m, new Trainer.Options());
    m.close();  // the trainer keeps the native model alive
    t.step(List.of(A));
    t.close();
    t.close();
    m.close();
    assertTrue(t.isClosed() && m.isClosed());
    assertThrows(IllegalStateException.class, () -> t.step(List.of(A)));
    assertThrows(IllegalStateException.class, t::cancel);
    assertThrows(IllegalStateException.class, m::numParams);
  }

  @Test
  void cancelFromAnotherThread() throws Exception {
    try (Model m = Model.fromPreset("tiny");
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(32).pageSize(32))) {
      t.cancel();
      assertEquals(SeqgradException.CANCELLED,
          assertThrows(SeqgradException.class, () -> t.step(List.of(A))).getCode());
      t.step(List.of(A));
      int[] longSeq = seq(512, 13, 5, 97);
      Thread canceller = new Thread(() -> {
        try {
          Thread.sleep(50);
        } catch (InterruptedException ignored) {
        }
        t.cancel();
      });
      canceller.start();
      SeqgradException e = assertThrows(SeqgradException.class, () -> {
        for (int i = 0; i < 100000; ++i) t.step(List.of(longSeq));
      });
      canceller.join();
      assertEquals(SeqgradException.CANCELLED, e.getCode());
      t.step(List.of(A));
    }
  }

  @Test
  void twoThreadsSteppingGetBusy() throws Exception {
    try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
      CountDownLatch inStep = new CountDownLatch(1);
      CountDownLatch bDone = new CountDownLatch(1);
      t.setProgressListener((step, loss, tokens, gn, phase) -> {
        if (inStep.getCount() > 0) {
          inStep.countDown();
          try {
            bDone.await(10, TimeUnit.SECONDS);
          } catch (InterruptedException ignored) {
          }
        }
      });
      AtomicReference<Throwable> bResult = new AtomicReference<>();
      AtomicReference<Metrics> aResult = new AtomicReference<>();
      Thread a = new Thread(() -> aResult.set(t.computeGradients(A, null, new long[] {A.length})));
      Thread b = new Thread(() -> {
        try {
          inStep.await(10, TimeUnit.SECONDS);
          t.step(List.of(A));
        } catch (Throwable e) {
          bResult.set(e);
        } finally {
          bDone.countDown();
        }
      });
      a.start();
      b.start();
      a.join();
      b.join();
      assertTrue(bResult.get() instanceof SeqgradException, String.valueOf(bResult.get()));
      assertEquals(SeqgradException.BUSY, ((SeqgradException) bResult.get()).getCode());
      assertNotNull(aResult.get());
    }
  }

  @Test
  void listenerExceptionPropagates() {
    try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
      t.setProgressListener((step, loss, tokens, gn, phase) -> {
        throw new IllegalArgumentException("boom");
      });
      assertThrows(IllegalArgumentException.class, () -> t.step(List.of(A)));
      t.setProgressListener(null);
      t.step(List.of(A));
      assertNull(null);
    }
  }
}
