package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
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
    assertEquals("0.2.0", Model.version());
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
        assertEquals(3 + 2, r.chunks);  // seco: 24 and 16 tokens in chunks of 8, all backpropagated
        assertEquals(r.chunks, r.chunksBackpropagated);
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

  static Trainer.Options spaco(long budget) {
    return new Trainer.Options().strategy("spaco").chunk(8).pageSize(8).spacoBudget(budget);
  }

  /** All gradients of the model, concatenated. */
  static float[] grads(Model m) {
    List<FloatBuffer> parts = new ArrayList<>();
    int total = 0;
    for (int i = 0; i < m.numParams(); ++i) {
      ByteBuffer g = m.grad(i);
      if (g == null) continue;
      parts.add(g.asFloatBuffer());
      total += parts.get(parts.size() - 1).capacity();
    }
    float[] out = new float[total];
    int off = 0;
    for (FloatBuffer f : parts) {
      f.get(out, off, f.capacity());
      off += f.capacity();
    }
    return out;
  }

  @Test
  void spacoTrainsOnASampleOfChunks() {
    try (Model m = Model.fromPreset("tiny", "f32", 1); Trainer t = Trainer.create(m, spaco(1).seed(7).lr(3e-3))) {
      for (int i = 1; i <= 4; ++i) {
        Metrics r = t.step(List.of(A, B));
        assertEquals(3 + 2, r.chunks);
        assertTrue(r.chunksBackpropagated >= 0 && r.chunksBackpropagated <= r.chunks, r.toString());
        assertEquals(23 + 15, r.tokens);
        assertEquals(i, r.step);
        assertTrue(Double.isFinite(r.loss));
      }
    }
  }

  @Test
  void spacoWithEveryChunkIsSeco() {
    int[] ids = new int[24 + 20];  // A and its first 20 tokens: 3 chunks of 8 each
    System.arraycopy(A, 0, ids, 0, 24);
    System.arraycopy(A, 0, ids, 24, 20);
    long[] lengths = {24, 20};
    try (Model m = Model.fromPreset("tiny", "f32", 1)) {
      Metrics ref, got;
      float[] seco, all;
      try (Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
        ref = t.computeGradients(ids, null, lengths);
        seco = grads(m);
      }
      // Budget = chunks per sequence keeps every chunk; no cap makes the compensation 1.
      try (Trainer t = Trainer.create(m, spaco(3).spacoCap(0).seed(99))) {
        got = t.computeGradients(ids, null, lengths);
        all = grads(m);
      }
      assertEquals(6, got.chunks);
      assertEquals(6, got.chunksBackpropagated);
      assertEquals(ref.loss, got.loss, 1e-6 * Math.abs(ref.loss));
      assertEquals(seco.length, all.length);
      for (int i = 0; i < seco.length; ++i) {
        assertEquals(seco[i], all[i], 1e-5 * (Math.abs(seco[i]) + 1e-3), "gradient " + i);
      }
    }
  }

  static float[] spacoSample(Model m, long seed) {
    try (Trainer t = Trainer.create(m, spaco(1).seed(seed))) {
      t.computeGradients(A, null, new long[] {A.length});
      return grads(m);
    }
  }

  @Test
  void spacoSeedDecidesTheSample() {
    try (Model m = Model.fromPreset("tiny", "f32", 1)) {
      float[] first = spacoSample(m, 5);
      assertArrayEquals(first, spacoSample(m, 5));
      boolean differs = false;
      for (long seed = -1; seed >= -8 && !differs; --seed) {  // negative: the bits are an unsigned seed
        differs = !Arrays.equals(first, spacoSample(m, seed));
      }
      assertTrue(differs);
    }
  }

  @Test
  void spacoBadOptionsNameTheOption() {
    try (Model m = Model.fromPreset("tiny")) {
      SeqgradException e = assertThrows(SeqgradException.class, () -> Trainer.create(m, spaco(0)));
      assertEquals(SeqgradException.INVALID_ARGUMENT, e.getCode());
      assertTrue(e.getMessage().contains("spaco_budget"), e.getMessage());
      e = assertThrows(SeqgradException.class, () -> Trainer.create(m, spaco(1).spacoCap(0.5)));
      assertTrue(e.getMessage().contains("spaco_cap"), e.getMessage());
      try (Trainer t = Trainer.create(m, spaco(3))) {
        e = assertThrows(SeqgradException.class, () -> t.step(List.of(A, B)));  // B has 2 chunks
        assertEquals(SeqgradException.INVALID_ARGUMENT, e.getCode());
        assertTrue(e.getMessage().contains("spaco_budget=3 exceeds the 2 chunks"), e.getMessage());
        t.step(List.of(A));
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
