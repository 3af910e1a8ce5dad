package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.DoubleBuffer;
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
  void devicesAndSetParam() throws Exception {
    // This library has no CUDA backend (or no GPU): the C ABI's clear error.
    FailedPreconditionException noGpu =
        assertThrows(FailedPreconditionException.class, () -> Model.fromPreset("tiny", "f32", 0, "cuda"));
    assertTrue(noGpu.getMessage().contains("device 'cuda' cannot run"), noGpu.getMessage());
    InvalidArgumentException bad =
        assertThrows(InvalidArgumentException.class, () -> Model.fromPreset("tiny", "f32", 0, "tpu"));
    assertTrue(bad.getMessage().contains("options->device is 'tpu'"), bad.getMessage());
    try (Model m = Model.fromPreset("tiny", "f32", 1, "cpu")) {
      assertEquals("cpu", m.device());
      int i = 0;
      while (!m.paramName(i).equals("model.norm.weight")) ++i;
      ByteBuffer values = ByteBuffer.allocate(32 * 4).order(java.nio.ByteOrder.nativeOrder());
      for (int k = 0; k < 32; ++k) values.putFloat(k * 0.25f);
      values.flip();
      m.setParam(i, values);
      FloatBuffer now = m.param(i).asFloatBuffer();
      for (int k = 0; k < 32; ++k) assertEquals(k * 0.25f, now.get(k));
      final int index = i;
      assertThrows(InvalidArgumentException.class, () -> m.setParam(index, ByteBuffer.allocate(8)));
      Path dir = Files.createTempDirectory("seqgrad-device");
      m.save(dir.toString());
      noGpu = assertThrows(FailedPreconditionException.class, () -> Model.load(dir.toString(), "f32", "cuda"));
      assertTrue(noGpu.getMessage().contains("device 'cuda' cannot run"), noGpu.getMessage());
    }
  }

  @Test
  void loadsFromJarAndTrains() throws Exception {
    assertEquals(Version.STRING, Model.version());  // both from cabi/version.bzl
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

  /** seco's gradients over A and B with pages of 2 tokens (the last chunk of A has 6 candidate pages). */
  static float[] secoGrads(Model m, long sparsePages, boolean offload) {
    Trainer.Options o = new Trainer.Options().strategy("seco").chunk(8).pageSize(2).sparsePages(sparsePages)
        .offload(offload);
    try (Trainer t = Trainer.create(m, o)) {
      int[] ids = new int[A.length + B.length];
      System.arraycopy(A, 0, ids, 0, A.length);
      System.arraycopy(B, 0, ids, A.length, B.length);
      t.computeGradients(ids, null, new long[] {A.length, B.length});
      return grads(m);
    }
  }

  @Test
  void offloadGivesTheSameGradientsDenseOrSparse() {
    try (Model m = Model.fromPreset("tiny", "f32", 1)) {
      float[] dense = secoGrads(m, 0, false), sparse = secoGrads(m, 1, false);
      assertArrayEquals(dense, secoGrads(m, 0, true));
      assertArrayEquals(sparse, secoGrads(m, 1, true));
      assertFalse(Arrays.equals(dense, sparse));
      InvalidArgumentException bad = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(m, new Trainer.Options().strategy("ckpt").offload(true)));
      assertTrue(bad.getMessage().contains("offload"), bad.getMessage());
      bad = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(m, new Trainer.Options().strategy("seco").sparsePages(-1)));
      assertTrue(bad.getMessage().contains("sparse_pages"), bad.getMessage());
    }
  }

  @Test
  void tensorParallelOptionReachesTheLibrary() {
    try (Model m = Model.fromPreset("tiny", "f32", 1)) {
      try (Trainer t = Trainer.create(m, new Trainer.Options().tp(1))) {  // tp 1: one process, nothing reduced
        Metrics r = t.step(List.of(A, B));
        assertEquals(1, r.tp);
        assertEquals(0, r.tpBytesReduced);
      }
      InvalidArgumentException bad = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(m, new Trainer.Options().tp(-2)));
      assertTrue(bad.getMessage().contains("options->tp is -2"), bad.getMessage());
    }
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
        assertTrue(e.getMessage().contains("spaco_budget = 3 exceeds the 2 chunks"), e.getMessage());
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
          assertThrows(OutOfRangeException.class, () -> m.paramName(100000)).getCode());
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
          assertThrows(CancelledException.class, () -> t.step(List.of(A))).getCode());
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
      assertTrue(bResult.get() instanceof BusyException, String.valueOf(bResult.get()));
      assertEquals(SeqgradException.BUSY, ((SeqgradException) bResult.get()).getCode());
      assertNotNull(aResult.get());
    }
  }

  /** A listener that throws after the update says the step was applied (a retry would apply the batch twice). */
  @Test
  void listenerExceptionSaysTheStepWasApplied() {
    for (int throwingPhase = 0; throwingPhase < 2; ++throwingPhase) {
      final int phaseToThrow = throwingPhase;
      try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
        int last = m.numParams() - 1;  // the final norm or head: every step moves it
        float before = m.param(last).getFloat(0);
        IllegalArgumentException boom = new IllegalArgumentException("boom");
        t.setProgressListener((step, loss, tokens, gn, phase) -> {
          if (phase == phaseToThrow) throw boom;
        });
        StepAppliedException e = assertThrows(StepAppliedException.class, () -> t.step(List.of(A)));
        assertSame(boom, e.getCause());
        assertEquals(1, e.getStep(), "phase " + phaseToThrow);
        assertEquals(1, t.stepCount());
        assertNotEquals(before, m.param(last).getFloat(0), "the weights moved");
        assertTrue(e.getMessage().contains("do not retry"), e.getMessage());

        if (phaseToThrow == 0) {  // the gradients are in place too
          e = assertThrows(StepAppliedException.class, () -> t.computeGradients(A, null, new long[] {A.length}));
          assertEquals(1, e.getStep());
        }
        t.setProgressListener(null);
        t.step(List.of(A));
        assertEquals(2, t.stepCount());
      }
    }
  }

  // ---- 0.3: streambp, evaluate, dpo, grpo, memory limit ----

  static void assertGradsClose(float[] got, float[] want, double rel, String what) {
    assertEquals(want.length, got.length);
    for (int i = 0; i < want.length; ++i) {
      // The floor: f32 GEMMs of different shapes (a chunk vs the whole sequence) block their sums differently.
      assertEquals(want[i], got[i], rel * (Math.abs(want[i]) + 1e-2), what + ": gradient " + i);
    }
  }

  @Test
  void streambpMatchesFullAndTrains() {
    try (Model m = Model.fromPreset("tiny", "f32", 1)) {
      Metrics ref, got;
      float[] full;
      try (Trainer t = Trainer.create(m, new Trainer.Options())) {
        ref = t.computeGradients(A, null, new long[] {A.length});
        full = grads(m);
      }
      try (Trainer t = Trainer.create(m, new Trainer.Options().strategy("streambp").chunk(8).pageSize(8).lr(3e-3))) {
        got = t.computeGradients(A, null, new long[] {A.length});
        assertGradsClose(grads(m), full, 1e-5, "streambp vs full");
        assertEquals(ref.loss, got.loss, 1e-5 * ref.loss);
        double first = t.step(List.of(A, B)).loss, last = first;
        for (int i = 0; i < 3; ++i) last = t.step(List.of(A, B)).loss;
        assertTrue(last < first, first + " -> " + last);
      }
    }
  }

  @Test
  void evaluateEqualsComputeGradientsLoss() {
    int[] labels = new int[A.length];  // Hugging Face's: every odd position's own token
    for (int i = 0; i < A.length; ++i) labels[i] = i % 2 == 1 ? A[i] : -100;
    try (Model m = Model.fromPreset("tiny", "f32", 1);
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
      Metrics g = t.computeGradients(A, labels, new long[] {A.length});
      float[] before = grads(m);
      Metrics e = t.evaluate(A, labels, new long[] {A.length});
      assertEquals(g.loss, e.loss, 1e-6 * g.loss);
      assertEquals(12, e.tokens);
      assertEquals(g.tokens, e.tokens);
      assertEquals(3, e.chunks);
      assertEquals(0, e.chunksBackpropagated);
      assertEquals(0, e.step);
      assertArrayEquals(before, grads(m));  // gradients untouched
    }
  }

  /** Prompt + response of n tokens: {ids, labels}, Hugging Face's labels (ids[t]) only on the response. */
  static int[][] promptResponse(int n, int prompt, int salt) {
    int[] ids = new int[n], labels = new int[n];
    for (int t = 0; t < n; ++t) ids[t] = (t * (5 + salt) + 3 * salt + 1) % 90;
    for (int t = 0; t < n; ++t) labels[t] = t >= prompt ? ids[t] : -100;
    return new int[][] {ids, labels};
  }

  static final int[][][] CHOSEN = {promptResponse(20, 5, 1), promptResponse(14, 5, 3)};
  static final int[][][] REJECTED = {promptResponse(12, 5, 2), promptResponse(17, 5, 4)};

  static double sequenceLogp(Trainer t, int[][] seq) {
    Metrics r = t.evaluate(seq[0], seq[1], new long[] {seq[0].length});
    return -r.loss * r.tokens;
  }

  static List<DpoPair> pairs(double[] refChosen, double[] refRejected) {
    List<DpoPair> out = new ArrayList<>();
    for (int i = 0; i < CHOSEN.length; ++i) {
      out.add(new DpoPair(CHOSEN[i][0], CHOSEN[i][1], REJECTED[i][0], REJECTED[i][1],
          refChosen == null ? Double.NaN : refChosen[i], refRejected == null ? Double.NaN : refRejected[i]));
    }
    return out;
  }

  @Test
  void dpoGivenRefLogprobsEqualReferenceModel() {
    try (Model policy = Model.fromPreset("tiny", "f32", 1); Model reference = Model.fromPreset("tiny", "f32", 1)) {
      try (Trainer sft = Trainer.create(policy, new Trainer.Options().lr(3e-3))) {
        for (int i = 0; i < 3; ++i) sft.step(List.of(A, B));  // move the policy away from the reference
      }
      double[] refC = new double[2], refR = new double[2];
      try (Trainer ev = Trainer.create(reference, new Trainer.Options())) {
        for (int i = 0; i < 2; ++i) {
          refC[i] = sequenceLogp(ev, CHOSEN[i]);
          refR[i] = sequenceLogp(ev, REJECTED[i]);
        }
      }
      try (Trainer t = Trainer.create(policy, new Trainer.Options().objective("dpo").dpoBeta(0.1))) {
        Metrics given = t.computeGradientsDpo(pairs(refC, refR));
        float[] gGiven = grads(policy);
        InvalidArgumentException e =
            assertThrows(InvalidArgumentException.class, () -> t.computeGradientsDpo(pairs(null, null)));
        assertTrue(e.getMessage().contains("no reference model"), e.getMessage());
        t.setReference(reference);
        Metrics viaModel = t.computeGradientsDpo(pairs(null, null));
        assertGradsClose(grads(policy), gGiven, 1e-5, "dpo: reference model vs given log-probs");
        assertTrue(Double.isFinite(given.loss) && Math.abs(given.loss - Math.log(2)) > 1e-4, given.toString());
        assertEquals(given.loss, viaModel.loss, 1e-5 * given.loss);
        assertEquals(given.tokens, viaModel.tokens);
        Metrics s = t.stepDpo(pairs(null, null));
        assertTrue(Double.isFinite(s.loss) && s.gradNorm > 0);
        assertEquals(1, s.step);
      }
      try (Trainer t = Trainer.create(policy, new Trainer.Options().objective("dpo").reference(reference))) {
        assertTrue(Double.isFinite(t.stepDpo(pairs(refC, null)).loss));
      }
    }
  }

  static List<List<GrpoCompletion>> groups(boolean logprobs) {
    double[][] advantages = {{1.0, -0.5, 0.5}, {2.0, 0.0}};
    List<List<GrpoCompletion>> out = new ArrayList<>();
    for (int g = 0; g < advantages.length; ++g) {
      List<GrpoCompletion> group = new ArrayList<>();
      for (int i = 0; i < advantages[g].length; ++i) {
        int[][] s = promptResponse(18 - 3 * i + g, 4, 3 * g + i);
        double[] old = null, ref = null;
        if (logprobs) {
          old = new double[s[0].length];
          ref = new double[s[0].length];
          for (int t = 0; t < old.length; ++t) {
            old[t] = s[1][t] >= 0 ? -4.5 + 0.01 * t : Double.NaN;
            ref[t] = s[1][t] >= 0 ? -4.6 : Double.NaN;
          }
        }
        group.add(new GrpoCompletion(s[0], s[1], advantages[g][i], old, ref));
      }
      out.add(group);
    }
    return out;
  }

  @Test
  void grpoSteps() {
    try (Model m = Model.fromPreset("tiny", "f32", 1); Model reference = Model.fromPreset("tiny", "f32", 1)) {
      // Ratio 1 (no old log-probs), no KL: the loss is -(mean over groups of the mean advantage).
      try (Trainer t = Trainer.create(m, new Trainer.Options().objective("grpo").grpoKlBeta(0))) {
        assertEquals(-(1.0 / 3 + 1.0) / 2, t.computeGradientsGrpo(groups(false)).loss, 1e-6);
        assertEquals(1, t.stepGrpo(groups(false)).step);
      }
      try (Trainer t = Trainer.create(m, new Trainer.Options().objective("grpo").grpoClipEps(0.2).grpoKlBeta(0.04))) {
        Metrics r = t.stepGrpo(groups(true));
        assertTrue(Double.isFinite(r.loss) && r.gradNorm > 0);
        assertEquals(1, r.step);
        InvalidArgumentException e = assertThrows(InvalidArgumentException.class, () -> t.stepGrpo(groups(false)));
        assertTrue(e.getMessage().contains("no reference model"), e.getMessage());
        t.setReference(reference);
        assertTrue(Double.isFinite(t.computeGradientsGrpo(groups(false)).loss));
      }
    }
  }

  @Test
  void grpoKlBiasCorrectionReachesTheLibrary() {
    assertTrue(new Trainer.Options().grpoKlBiasCorrection, "on by default, as TRL's use_bias_correction_kl");
    try (Model m = Model.fromPreset("tiny", "f64", 1)) {
      Trainer.Options[] options = {new Trainer.Options(), new Trainer.Options().grpoKlBiasCorrection(true),
          new Trainer.Options().grpoKlBiasCorrection(false)};
      double[] loss = new double[options.length];
      for (int k = 0; k < options.length; ++k) {
        try (Trainer t = Trainer.create(m, options[k].objective("grpo").grpoKlBeta(0.5))) {
          loss[k] = t.computeGradientsGrpo(groups(true)).loss;
        }
      }
      assertEquals(loss[1], loss[0], 0.0);
      assertTrue(Math.abs(loss[1] - loss[2]) > 1e-6, loss[1] + " vs " + loss[2]);
    }
  }

  @Test
  void objectiveErrorsAreTyped() {
    try (Model m = Model.fromPreset("tiny", "f32", 1); Trainer t =
             Trainer.create(m, new Trainer.Options().objective("grpo"))) {
      List<List<GrpoCompletion>> empty = new ArrayList<>(groups(true));
      empty.set(1, new ArrayList<>());
      InvalidArgumentException e = assertThrows(InvalidArgumentException.class, () -> t.stepGrpo(empty));
      assertEquals(SeqgradException.INVALID_ARGUMENT, e.getCode());
      assertTrue(e.getMessage().contains("groups[1] is empty (G = 0)"), e.getMessage());
      List<List<GrpoCompletion>> bad = groups(true);
      GrpoCompletion c = bad.get(0).get(1);
      bad.get(0).set(1, new GrpoCompletion(c.ids, c.labels, c.advantage, Arrays.copyOf(c.oldLogprobs, 3), null));
      e = assertThrows(InvalidArgumentException.class, () -> t.stepGrpo(bad));
      assertTrue(e.getMessage().contains("groups[0][1].oldLogprobs has 3 entries"), e.getMessage());
      List<List<GrpoCompletion>> nan = groups(true);
      nan.get(1).get(0).oldLogprobs[5] = Double.NaN;  // a labelled position: checked by the C API
      e = assertThrows(InvalidArgumentException.class, () -> t.stepGrpo(nan));
      assertTrue(e.getMessage().contains("old_logprobs[3][5] is nan (group 1)"), e.getMessage());
      FailedPreconditionException f = assertThrows(FailedPreconditionException.class, () -> t.step(List.of(A)));
      assertEquals(SeqgradException.FAILED_PRECONDITION, f.getCode());
      assertTrue(f.getMessage().contains("objective is 'grpo'"), f.getMessage());
      assertThrows(FailedPreconditionException.class, () -> t.stepDpo(pairs(null, null)));
      e = assertThrows(InvalidArgumentException.class, () -> t.setReference(m));
      assertTrue(e.getMessage().contains("own model"), e.getMessage());
      assertEquals(0, t.stepCount());
    }
    try (Model m = Model.fromPreset("tiny")) {
      InvalidArgumentException e = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(m, new Trainer.Options().objective("ppo")));
      assertTrue(e.getMessage().contains("options->objective is 'ppo'"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(m, new Trainer.Options().objective("dpo").dpoBeta(-1)));
      assertTrue(e.getMessage().contains("dpo_beta"), e.getMessage());
      try (Trainer t = Trainer.create(m, new Trainer.Options().objective("dpo"))) {
        e = assertThrows(InvalidArgumentException.class, () -> t.stepDpo(List.of(
            new DpoPair(CHOSEN[0][0], new int[] {1}, REJECTED[0][0], REJECTED[0][1], -1, -1))));
        assertTrue(e.getMessage().contains("pairs[0].chosenLabels has 1 entries but chosenIds has 20"),
            e.getMessage());
      }
    }
  }

  @Test
  void memoryLimitIsTyped() {
    try (Model m = Model.fromPreset("tiny", "f32", 1);
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
      assertEquals(0, m.memoryLimit());
      m.setMemoryLimit(1024);
      assertEquals(1024, m.memoryLimit());
      ResourceExhaustedException e = assertThrows(ResourceExhaustedException.class, () -> t.step(List.of(A, B)));
      assertEquals(SeqgradException.RESOURCE_EXHAUSTED, e.getCode());
      assertEquals("RESOURCE_EXHAUSTED", e.getCodeName());
      assertTrue(e.getMessage().contains("memory limit of 1024 bytes exceeded"), e.getMessage());
      assertThrows(ResourceExhaustedException.class, () -> t.evaluate(A, null, new long[] {A.length}));
      assertEquals(0, t.stepCount());
      m.setMemoryLimit(0);
      Metrics r = t.step(List.of(A, B));
      assertEquals(1, r.step);
      assertTrue(Double.isFinite(r.loss));
      InvalidArgumentException bad = assertThrows(InvalidArgumentException.class, () -> m.setMemoryLimit(-1));
      assertTrue(bad.getMessage().contains("'bytes' is -1"), bad.getMessage());
    }
  }

  // ---- Mamba-1 SSMs through the same ABI ----

  /** All gradients of an f64 model, concatenated. */
  static double[] grads64(Model m) {
    List<DoubleBuffer> parts = new ArrayList<>();
    int total = 0;
    for (int i = 0; i < m.numParams(); ++i) {
      assertEquals("f64", m.paramDType(i));
      ByteBuffer g = m.grad(i);
      if (g == null) continue;
      parts.add(g.asDoubleBuffer());
      total += parts.get(parts.size() - 1).capacity();
    }
    double[] out = new double[total];
    int off = 0;
    for (DoubleBuffer d : parts) {
      d.get(out, off, d.capacity());
      off += d.capacity();
    }
    return out;
  }

  /**
   * dtype "bf16", both families: matrices are bf16 (2-byte views) with f32 gradients; training works and reports the
   * fp32 masters under master_weights; a save in bf16 (the default) or f32 reloads into bf16 with the same bits.
   */
  @Test
  void bf16ModelsTrainSaveAndReload() throws Exception {
    List<String> categories = Model.memoryCategories();
    assertEquals(9, categories.size());
    int masters = categories.indexOf("master_weights");
    assertEquals(8, masters);  // appended: the other categories keep their numbers
    Path dir = Files.createTempDirectory("seqgrad-java-bf16");
    for (String preset : List.of("tiny", "tiny-ssm")) {
      try (Model m = Model.fromPreset(preset, "bf16", 1);
           Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8).lr(3e-3))) {
        assertEquals("bf16", m.paramDType(0));  // the embedding
        double first = 0;
        Metrics r = null;
        for (int i = 0; i < 4; ++i) {
          r = t.step(List.of(A, B));
          if (i == 0) first = r.loss;
        }
        assertTrue(r.loss < first, preset + ": loss went down: " + first + " -> " + r.loss);
        assertEquals(9, r.peakBytesByCategory.length);
        assertTrue(r.peakBytesByCategory[masters] > 0, preset);
        assertEquals(r.peakBytes, Arrays.stream(r.bytesAtPeakByCategory).sum(), preset);
        ByteBuffer w = m.param(0);
        long numel = Arrays.stream(m.paramShape(0)).reduce(1, (a, b) -> a * b);
        assertEquals(2 * numel, w.capacity());
        assertEquals(4 * numel, m.grad(0).capacity());  // f32 gradients

        String bf16 = dir.resolve(preset + "-bf16").toString(), f32 = dir.resolve(preset + "-f32").toString();
        m.save(bf16);
        m.save(f32, "f32");
        for (String saved : List.of(bf16, f32)) {
          try (Model back = Model.load(saved, "bf16")) {
            assertEquals(w, back.param(0), saved);  // the same bf16 bits
          }
        }
        try (Model wide = Model.load(f32, "f32")) {
          assertEquals("f32", wide.paramDType(0));
          assertEquals(Float.intBitsToFloat((w.getShort(10) & 0xffff) << 16), wide.param(0).asFloatBuffer().get(5));
        }
        assertThrows(InvalidArgumentException.class, () -> m.save(bf16, "f16"));
      }
    }
    try (Model f32 = Model.fromPreset("tiny", "f32", 1)) {
      InvalidArgumentException e =
          assertThrows(InvalidArgumentException.class, () -> f32.save(dir.resolve("x").toString(), "bf16"));
      assertTrue(e.getMessage().contains("'dtype' is bf16"), e.getMessage());
    }
  }

  @Test
  void ssmStrategiesMatchFullAndSaveLoadRoundTrips() throws Exception {
    List<String> presets = Model.presetNames();
    assertTrue(presets.containsAll(List.of("tiny", "tiny-ssm", "bench-ssm")), presets.toString());
    int[] ids = new int[A.length + B.length];
    System.arraycopy(A, 0, ids, 0, A.length);
    System.arraycopy(B, 0, ids, A.length, B.length);
    long[] lengths = {A.length, B.length};
    try (Model m = Model.fromPreset("tiny-ssm", "f64", 3)) {
      assertEquals("ssm", m.family());
      assertEquals(97, m.vocabSize());
      assertEquals(3, m.numLayers());
      Metrics ref;
      double[] full;
      try (Trainer t = Trainer.create(m, new Trainer.Options())) {
        ref = t.computeGradients(ids, null, lengths);
        full = grads64(m);
      }
      assertTrue(Double.isFinite(ref.loss));
      for (String strategy : List.of("ckpt", "seco", "streambp")) {
        try (Trainer t = Trainer.create(m, new Trainer.Options().strategy(strategy).chunk(8).pageSize(8))) {
          Metrics got = t.computeGradients(ids, null, lengths);
          assertEquals(ref.loss, got.loss, 1e-12 * Math.abs(ref.loss), strategy);
          double[] g = grads64(m);
          assertEquals(full.length, g.length);
          for (int i = 0; i < full.length; ++i) {
            assertEquals(full[i], g[i], 1e-9 * (Math.abs(full[i]) + 1e-3), strategy + " vs full: gradient " + i);
          }
        }
      }
      try (Trainer t = Trainer.create(m, spaco(1).seed(7))) {
        Metrics r = t.computeGradients(ids, null, lengths);
        assertTrue(Double.isFinite(r.loss));
        assertEquals(3 + 2, r.chunks);
      }

      Path dir = Files.createTempDirectory("seqgrad-java-ssm");
      m.save(dir.resolve("ssm").toString());
      try (Model loaded = Model.load(dir.resolve("ssm").toString(), "f64");
           Trainer t1 = Trainer.create(m, new Trainer.Options());
           Trainer t2 = Trainer.create(loaded, new Trainer.Options())) {
        assertEquals("ssm", loaded.family());
        assertEquals(m.numParams(), loaded.numParams());
        assertEquals(t1.evaluate(ids, null, lengths).loss, t2.evaluate(ids, null, lengths).loss);
      }
    }
  }

  @Test
  void ssmTrainsWithSecoAndStreambp() {
    for (String strategy : List.of("seco", "streambp")) {
      try (Model m = Model.fromPreset("tiny-ssm", "f32", 5);
           Trainer t = Trainer.create(m, new Trainer.Options().strategy(strategy).chunk(8).pageSize(8).lr(3e-3))) {
        assertEquals("ssm", m.family());
        double first = t.step(List.of(A, B)).loss, last = first;
        for (int i = 0; i < 4; ++i) {
          last = t.step(List.of(A, B)).loss;
          assertTrue(Double.isFinite(last), strategy);
        }
        assertTrue(last < first, strategy + ": " + first + " -> " + last);
      }
    }
  }

  // ---- 0.4: adjoint (adjoint sharding for SSMs) ----

  /** (t, i) pairs per channel summed over layers: w T - w (w - 1) / 2 per layer and sequence (window w <= T). */
  static long adjointPairs(long[] lengths, long layers, long window) {
    long total = 0;
    for (long n : lengths) {
      long t = n - 1;  // positions: the last token is only a label
      long w = Math.min(window, t);
      total += layers * (w * t - w * (w - 1) / 2);
    }
    return total;
  }

  static Trainer.Options adjoint(long chunk) {
    return new Trainer.Options().strategy("adjoint").chunk(chunk).pageSize(8);
  }

  /**
   * Over the parameters of m (gradients concatenated as {@link #grads64} does): the largest max |got - want| of a
   * parameter relative to its max |want|. The scan parameters' gradients are small next to the embeddings'.
   */
  static double relErr(Model m, double[] got, double[] want) {
    double worst = 0;
    int off = 0;
    for (int p = 0; p < m.numParams(); ++p) {
      ByteBuffer g = m.grad(p);
      if (g == null) continue;
      int n = g.asDoubleBuffer().capacity();
      double diff = 0, scale = 0;
      for (int i = off; i < off + n; ++i) {
        diff = Math.max(diff, Math.abs(got[i] - want[i]));
        scale = Math.max(scale, Math.abs(want[i]));
      }
      if (scale > 0) worst = Math.max(worst, diff / scale);
      off += n;
    }
    return worst;
  }

  @Test
  void adjointMatchesFullOnSsm() {
    int[] ids = new int[A.length + B.length];
    System.arraycopy(A, 0, ids, 0, A.length);
    System.arraycopy(B, 0, ids, A.length, B.length);
    long[] lengths = {A.length, B.length};
    try (Model m = Model.fromPreset("tiny-ssm", "f64", 3)) {
      Metrics ref;
      double[] full;
      try (Trainer t = Trainer.create(m, new Trainer.Options())) {
        ref = t.computeGradients(ids, null, lengths);
        full = grads64(m);
      }
      assertEquals(0, ref.adjointPairs);
      long noWindow = adjointPairs(lengths, m.numLayers(), Long.MAX_VALUE);
      assertEquals(3 * (23 * 24 / 2 + 15 * 16 / 2), noWindow);
      List<Trainer.Options> exact = List.of(adjoint(8), adjoint(5).adjointForm("pairs"), adjoint(8).adjointWindow(24),
          adjoint(8).adjointWindow(1000), adjoint(8).adjointForm(null), adjoint(8).adjointForm("scan"));
      for (Trainer.Options o : exact) {
        String what = o.adjointForm + " chunk " + o.chunk + " window " + o.adjointWindow;
        try (Trainer t = Trainer.create(m, o)) {
          Metrics got = t.computeGradients(ids, null, lengths);
          assertEquals(ref.loss, got.loss, 1e-12 * Math.abs(ref.loss), what);
          assertEquals(ref.tokens, got.tokens, what);
          assertEquals("scan".equals(o.adjointForm) ? 0 : noWindow, got.adjointPairs, what);
          double[] g = grads64(m);
          assertEquals(full.length, g.length);
          for (int i = 0; i < full.length; ++i) {
            assertEquals(full[i], g[i], 1e-10 * (Math.abs(full[i]) + 1e-3), what + " vs full: gradient " + i);
          }
          assertEquals(0, t.evaluate(ids, null, lengths).adjointPairs, what);
        }
      }
      try (Trainer t = Trainer.create(m, adjoint(8))) {
        t.computeGradients(ids, null, lengths);
        Metrics r = t.optimizerStep();  // the last compute_gradients' count
        assertEquals(noWindow, r.adjointPairs);
        assertEquals(1, r.step);
      }
    }
  }

  @Test
  void adjointWindowTruncatesAndTrains() {
    int[] ids = new int[A.length + B.length];
    System.arraycopy(A, 0, ids, 0, A.length);
    System.arraycopy(B, 0, ids, A.length, B.length);
    long[] lengths = {A.length, B.length};
    try (Model m = Model.fromPreset("tiny-ssm", "f64", 3)) {
      Metrics ref;
      double[] full;
      try (Trainer t = Trainer.create(m, new Trainer.Options())) {
        ref = t.computeGradients(ids, null, lengths);
        full = grads64(m);
      }
      double first = 0, err = 0;
      for (long w : new long[] {1, 4, 12}) {
        try (Trainer t = Trainer.create(m, adjoint(8).adjointWindow(w))) {
          Metrics got = t.computeGradients(ids, null, lengths);
          assertEquals(3 * ((w * 23 - w * (w - 1) / 2) + (w * 15 - w * (w - 1) / 2)), got.adjointPairs, "window " + w);
          assertEquals(adjointPairs(lengths, m.numLayers(), w), got.adjointPairs);
          assertEquals(ref.loss, got.loss, 1e-12 * Math.abs(ref.loss), "the forward pass is not truncated");
          err = relErr(m, grads64(m), full);
          assertTrue(err > 1e-3, "window " + w + " changes the gradient: " + err);
          if (w == 1) first = err;
        }
      }
      assertTrue(err < first, "the error shrinks as the window grows: " + first + " -> " + err);
      try (Trainer t = Trainer.create(m, adjoint(8).adjointForm("paper").adjointWindow(4))) {
        assertEquals(adjointPairs(lengths, m.numLayers(), 4), t.computeGradients(ids, null, lengths).adjointPairs);
      }
    }
    try (Model m = Model.fromPreset("tiny-ssm", "f32", 5);
         Trainer t = Trainer.create(m, adjoint(8).adjointWindow(8).lr(3e-3))) {
      double first = t.step(List.of(A, B)).loss, last = first;
      for (int i = 0; i < 4; ++i) {
        last = t.step(List.of(A, B)).loss;
        assertTrue(Double.isFinite(last));
      }
      assertTrue(last < first, first + " -> " + last);
    }
  }

  @Test
  void adjointBadOptionsAreTyped() {
    try (Model ssm = Model.fromPreset("tiny-ssm", "f32", 3); Model transformer = Model.fromPreset("tiny")) {
      for (long w : new long[] {0, -3}) {
        InvalidArgumentException e =
            assertThrows(InvalidArgumentException.class, () -> Trainer.create(ssm, adjoint(8).adjointWindow(w)));
        assertEquals(SeqgradException.INVALID_ARGUMENT, e.getCode());
        assertTrue(e.getMessage().contains("adjoint_window is " + w), e.getMessage());
      }
      InvalidArgumentException e = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(ssm, new Trainer.Options().adjointWindow(0)));  // checked whatever the strategy
      assertTrue(e.getMessage().contains("adjoint_window"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> Trainer.create(ssm, adjoint(8).adjointForm("reverse")));
      assertTrue(e.getMessage().contains("adjoint_form is 'reverse'"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(ssm, adjoint(8).adjointForm("scan").adjointWindow(8)));
      assertTrue(e.getMessage().contains("scan is exact and has no window"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> Trainer.create(transformer, adjoint(8)));
      assertTrue(e.getMessage().contains("needs a state-space model"), e.getMessage());
      try (Trainer t = Trainer.create(ssm, adjoint(8).adjointWindow(Trainer.Options.NO_ADJOINT_WINDOW))) {
        assertTrue(t.step(List.of(A)).adjointPairs == adjointPairs(new long[] {A.length}, 3, Long.MAX_VALUE));
      }
    }
  }

  // ---- 0.5: LR schedule, gradient accumulation, LoRA, checkpoints, detailed evaluation ----

  static Trainer.Options cosine(long totalSteps) {
    return new Trainer.Options().strategy("seco").chunk(8).pageSize(8).lr(2e-2).lrSchedule("cosine").warmupSteps(2)
        .minLr(1e-3).totalSteps(totalSteps).gradAccum(2);
  }

  static LoraOptions lora() {
    return new LoraOptions().rank(4).dropout(0.1).targets("q_proj,k_proj,v_proj,o_proj").seed(4);
  }

  /** Micro-batch k of the checkpoint tests: A and B rotated by k. */
  static List<int[]> microBatch(int k) {
    int[] a = new int[A.length], b = new int[B.length];
    for (int i = 0; i < a.length; ++i) a[i] = A[(i + 3 * k) % a.length];
    for (int i = 0; i < b.length; ++i) b[i] = B[(i + 5 * k) % b.length];
    return List.of(a, b);
  }

  /**
   * A LoRA training loop (f64, seed fixed, cosine, 2 micro-batches per step) checkpointing into outDir every 2 steps;
   * resumes from outDir if asked. Returns the losses of the steps it ran.
   */
  static List<Double> loraRun(Path outDir, int steps, int stopAt, boolean resume) {
    List<Double> losses = new ArrayList<>();
    try (Model m = Model.fromPreset("tiny", "f64", 4)) {
      m.enableLora(lora());
      try (Trainer t = Trainer.create(m, cosine(steps))) {
        long position = 0;
        if (resume) {
          CheckpointState s = t.resume(outDir.toString(), true);
          if (s != null) position = s.dataPosition;
        }
        while (t.stepCount() < stopAt) {
          for (int i = 0; i < 2; ++i) {
            Metrics micro = t.accumulateGradients(microBatch((int) position++));
            assertEquals(0, micro.microBatches);
          }
          Metrics r = t.optimizerStep();
          assertEquals(2, r.microBatches);
          assertTrue(r.lr > 0);
          losses.add(r.loss);
          if (r.step % 2 == 0) t.saveCheckpoint(outDir.toString(), position, 2);
        }
      }
    }
    return losses;
  }

  @Test
  void loraCheckpointResumeGivesEqualLosses() throws Exception {
    Path dir = Files.createTempDirectory("seqgrad-java-ckpt");
    List<Double> full = loraRun(dir.resolve("a"), 6, 6, false);
    List<Double> first = loraRun(dir.resolve("b"), 6, 3, false);  // stopped after step 3: newest checkpoint step 2
    assertEquals(List.of("checkpoint-2"), list(dir.resolve("b")));
    List<Double> rest = loraRun(dir.resolve("b"), 6, 6, true);
    assertEquals(full.subList(0, 3), first);
    assertEquals(full.subList(2, 6), rest);  // bit-identical from step 3 on
    assertEquals(List.of("checkpoint-4", "checkpoint-6"), list(dir.resolve("b")));  // keep = 2
  }

  static List<String> list(Path dir) throws Exception {
    List<String> names = new ArrayList<>();
    try (var s = Files.list(dir)) {
      s.forEach(p -> names.add(p.getFileName().toString()));
    }
    names.sort(null);
    return names;
  }

  @Test
  void frozenBaseHasNoGradientsAndTrainsLoraAlike() {
    try (Model frozen = Model.fromPreset("tiny", "f64", 1, null, true);
        Model whole = Model.fromPreset("tiny", "f64", 1)) {
      for (int i = 0; i < frozen.numParams(); ++i) {
        assertNull(frozen.grad(i), frozen.paramName(i));
      }
      try (Trainer t = Trainer.create(frozen, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
        FailedPreconditionException e = assertThrows(FailedPreconditionException.class, () -> t.step(List.of(A, B)));
        assertTrue(e.getMessage().contains("frozen_base"), e.getMessage());
      }
      for (Model m : List.of(frozen, whole)) {
        m.enableLora(new LoraOptions().rank(4).targets(List.of("q_proj", "v_proj")).seed(3));
      }
      Trainer.Options o = new Trainer.Options().strategy("seco").chunk(8).pageSize(8).lr(1e-2);
      try (Trainer a = Trainer.create(frozen, o);
          Trainer b = Trainer.create(whole, o)) {
        for (int i = 0; i < 3; ++i) {
          assertEquals(b.step(List.of(A, B)).loss, a.step(List.of(A, B)).loss);
        }
      }
    }
  }

  @Test
  void loraStepAdaptersAndMergedSave() throws Exception {
    Path dir = Files.createTempDirectory("seqgrad-java-lora");
    try (Model m = Model.fromPreset("tiny", "f64", 1)) {
      assertNull(m.lora());
      int base = m.numParams();
      m.enableLora(new LoraOptions().rank(4).alpha(8).targets(List.of("q_proj", "v_proj")).seed(3));
      LoraOptions info = m.lora();
      assertEquals(4, info.rank);
      assertEquals(8.0, info.alpha);
      assertEquals(List.of("q_proj", "v_proj"), info.targetList());
      assertEquals(base + 12, m.numParams());  // 3 layers x 2 modules x (A, B)
      assertEquals("model.layers.0.self_attn.q_proj.lora_A.weight", m.paramName(base));
      FailedPreconditionException again = assertThrows(FailedPreconditionException.class, () -> m.enableLora(lora()));
      assertTrue(again.getMessage().contains("already enabled"), again.getMessage());
      double evaluated;
      try (Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8).lr(1e-2))) {
        double first = 0, last = 0;
        for (int i = 0; i < 6; ++i) {
          Metrics r = t.step(List.of(A, B));
          if (i == 0) first = r.loss;
          last = r.loss;
          assertEquals(1, r.microBatches);
          assertEquals(1e-2, r.lr);
        }
        assertTrue(last < first, first + " -> " + last);
        for (int i = 0; i < m.numParams(); ++i) {
          assertEquals(m.paramName(i).contains(".lora_"), m.grad(i) != null, m.paramName(i));  // base frozen
        }
        evaluated = t.evaluate(concat(A, B), null, new long[] {A.length, B.length}).loss;
      }
      m.saveLoraAdapter(dir.resolve("adapter").toString(), "seqgrad/tiny");
      assertEquals(List.of("adapter_config.json", "adapter_model.safetensors"), list(dir.resolve("adapter")));
      m.save(dir.resolve("merged").toString());
      try (Model fresh = Model.fromPreset("tiny", "f64", 1)) {
        fresh.loadLoraAdapter(dir.resolve("adapter").toString());  // enables LoRA with the adapter's options
        assertEquals(4, fresh.lora().rank);
        try (Trainer t = Trainer.create(fresh, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
          assertEquals(evaluated, t.evaluate(concat(A, B), null, new long[] {A.length, B.length}).loss);
        }
      }
      try (Model merged = Model.load(dir.resolve("merged").toString(), "f64")) {
        assertNull(merged.lora());
        assertEquals(base, merged.numParams());
        try (Trainer t = Trainer.create(merged, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
          assertEquals(evaluated, t.evaluate(concat(A, B), null, new long[] {A.length, B.length}).loss, 1e-12);
        }
      }
      try (Model other = Model.fromPreset("demo", "f64", 0)) {
        InvalidArgumentException e = assertThrows(InvalidArgumentException.class,
            () -> other.loadLoraAdapter(dir.resolve("adapter").toString()));
        assertTrue(e.getMessage().contains("different base model") && e.getMessage().contains("shape"),
            e.getMessage());
        assertThrows(NotFoundException.class, () -> other.loadLoraAdapter(dir.resolve("missing").toString()));
      }
    }
    try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
      FailedPreconditionException e = assertThrows(FailedPreconditionException.class, () -> m.enableLora(lora()));
      assertTrue(e.getMessage().contains("before creating trainers"), e.getMessage());
      assertThrows(FailedPreconditionException.class, () -> m.saveLoraAdapter("/tmp/never", null));
    }
    try (Model m = Model.fromPreset("tiny")) {
      InvalidArgumentException e =
          assertThrows(InvalidArgumentException.class, () -> m.enableLora(new LoraOptions().targets("x_proj")));
      assertTrue(e.getMessage().contains("options->targets: 'x_proj'"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> m.enableLora(new LoraOptions().rank(0)));
      assertTrue(e.getMessage().contains("options->rank is 0"), e.getMessage());
      m.enableLora(new LoraOptions().targets("all"));
      assertEquals(7, m.lora().targetList().size());
    }
  }

  static int[] concat(int[] a, int[] b) {
    int[] r = Arrays.copyOf(a, a.length + b.length);
    System.arraycopy(b, 0, r, a.length, b.length);
    return r;
  }

  @Test
  void badCheckpointsThrowTypedExceptions() throws Exception {
    Path dir = Files.createTempDirectory("seqgrad-java-bad");
    String run = dir.resolve("run").toString();
    String path;
    try (Model m = Model.fromPreset("tiny", "f32", 1);
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
      assertNull(t.resume(run, true));
      NotFoundException nf = assertThrows(NotFoundException.class, () -> t.resume(run, false));
      assertEquals(SeqgradException.NOT_FOUND, nf.getCode());
      t.step(List.of(A, B));
      path = t.saveCheckpoint(run, 7, 0);
      assertEquals(run + "/checkpoint-1", path);
      t.step(List.of(A, B));
      CheckpointState s = t.loadCheckpoint(path);
      assertEquals(1, s.step);
      assertEquals(7, s.dataPosition);
      assertEquals(1, t.stepCount());
      assertThrows(InvalidArgumentException.class, () -> t.saveCheckpoint(run, -1, 0));
    }
    try (Model m = Model.fromPreset("tiny", "f32", 1);
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(16).pageSize(8))) {
      FailedPreconditionException e = assertThrows(FailedPreconditionException.class, () -> t.resume(run, false));
      assertTrue(e.getMessage().contains("strategy.chunk: checkpoint '8', now '16'"), e.getMessage());
    }
    Path weights = Path.of(path, "model.safetensors");
    byte[] bytes = Files.readAllBytes(weights);
    bytes[300] ^= (byte) 0xFF;
    Files.write(weights, bytes);
    try (Model m = Model.fromPreset("tiny", "f32", 1);
         Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8))) {
      DataLossException e = assertThrows(DataLossException.class, () -> t.loadCheckpoint(path));
      assertEquals(SeqgradException.DATA_LOSS, e.getCode());
      assertEquals("DATA_LOSS", e.getCodeName());
      assertTrue(e.getMessage().contains("model.safetensors") && e.getMessage().contains("CRC-32"), e.getMessage());
      Files.write(weights, Arrays.copyOf(bytes, 1000));
      e = assertThrows(DataLossException.class, () -> t.loadCheckpoint(path));
      assertTrue(e.getMessage().contains("truncated"), e.getMessage());
      assertThrows(NotFoundException.class, () -> t.resume(run, false));  // the only checkpoint is damaged
      assertEquals(0, t.stepCount());
    }
  }

  @Test
  void scheduleAccumulationAndDetailedEvaluation() {
    try (Model one = Model.fromPreset("tiny", "f64", 2); Model acc = Model.fromPreset("tiny", "f64", 2);
         Trainer t1 = Trainer.create(one, cosine(5)); Trainer t2 = Trainer.create(acc, cosine(5))) {
      for (int step = 1; step <= 3; ++step) {
        Metrics r1 = t1.step(List.of(A, B));
        t2.accumulateGradients(List.of(A));
        t2.accumulateGradients(B, null, new long[] {B.length});
        Metrics r2 = t2.optimizerStep();
        assertEquals(r1.loss, r2.loss, 1e-12 * r1.loss);
        assertEquals(r1.lr, r2.lr);
        assertEquals(step == 1 ? 1e-2 : step == 2 ? 2e-2 : 1e-3 + (2e-2 - 1e-3) * 0.5 * (1 + Math.cos(Math.PI / 3)),
            r2.lr, 1e-15);
        assertEquals(2, r2.microBatches);
      }
      // Retrieval-style labels: only some positions, each with the distance back to its key (both aligned with ids;
      // positions 1, 5, ..., 37: none is a sequence's first, which is never predicted).
      int[] ids = concat(A, B);
      int[] labels = new int[ids.length];
      long[] distances = new long[ids.length];
      for (int i = 0; i < ids.length; ++i) {
        labels[i] = i % 4 == 1 ? ids[i] : -100;
        distances[i] = labels[i] >= 0 ? i : 0;
      }
      long[] lengths = {A.length, B.length};
      EvalResult r = t2.evaluateDetailed(ids, labels, lengths, distances);
      assertEquals(10, r.tokens);
      assertEquals(t2.evaluate(ids, labels, lengths).loss, r.loss, 1e-12);
      assertEquals(Math.exp(r.loss), r.perplexity, 1e-9 * r.perplexity);
      assertEquals(6, r.bucketCount.length);  // distances 1 .. 37: buckets [1,2) .. [32,64)
      assertEquals(10, Arrays.stream(r.bucketCount).sum());
      assertEquals(32, EvalResult.bucketLow(5));
      assertEquals(0, t2.evaluateDetailed(ids, labels, lengths, null).bucketCount.length);
      distances[0] = 0;  // no label there: ignored
      assertEquals(r.loss, t2.evaluateDetailed(ids, labels, lengths, distances).loss);
      distances[25] = 0;  // the label at B's position 1
      InvalidArgumentException e =
          assertThrows(InvalidArgumentException.class, () -> t2.evaluateDetailed(ids, labels, lengths, distances));
      assertTrue(e.getMessage().contains("distances[25] is 0"), e.getMessage());
      InvalidArgumentException bad = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(one, new Trainer.Options().lrSchedule("cosine").totalSteps(0)));
      assertTrue(bad.getMessage().contains("total_steps must be larger"), bad.getMessage());
      bad = assertThrows(InvalidArgumentException.class,
          () -> Trainer.create(one, new Trainer.Options().gradAccum(0)));
      assertTrue(bad.getMessage().contains("grad_accum is 0"), bad.getMessage());
    }
  }
}
