package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertEquals;
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
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.function.Function;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/** Lifetimes of handles and views, Cleaners, the exception classes and null arguments. */
class HandlesTest {
  static final int[] A = SeqgradTest.A;

  /** Collects garbage until the native live-handle count is at most {@code target}; returns the count reached. */
  static long collectUntil(long target) throws InterruptedException {
    long live = NativeApi.liveHandles();
    for (int i = 0; i < 200 && live > target; ++i) {
      System.gc();
      Thread.sleep(20);
      live = NativeApi.liveHandles();
    }
    return live;
  }

  /** Collects garbage until the live-handle count stops falling (what other tests left behind is freed). */
  static long settle() throws InterruptedException {
    long live = NativeApi.liveHandles();
    for (int same = 0, i = 0; same < 3 && i < 100; ++i) {
      System.gc();
      Thread.sleep(20);
      long now = NativeApi.liveHandles();
      same = now == live ? same + 1 : 0;
      live = now;
    }
    return live;
  }

  /** Resident memory of this process in bytes (VmRSS). */
  static long rssBytes() throws Exception {
    for (String line : Files.readAllLines(Path.of("/proc/self/status"))) {
      if (line.startsWith("VmRSS:")) return Long.parseLong(line.replaceAll("[^0-9]", "")) * 1024;
    }
    throw new AssertionError("no VmRSS in /proc/self/status");
  }

  @Test
  void viewsKeepTheModelAliveAfterClose() throws Exception {
    long before = settle();
    Model m = Model.fromPreset("tiny", "f32", 1);
    float[] weights = new float[m.param(0).asFloatBuffer().capacity()];
    m.param(0).asFloatBuffer().get(weights);
    FloatBuffer view = m.param(0).asFloatBuffer();  // derived buffers keep their parent (and its Cleaner) reachable
    ByteBuffer slice = m.param(0).position(8).slice();
    ByteBuffer grad = m.grad(0);
    m.close();
    assertThrows(IllegalStateException.class, () -> m.param(0));

    // Churn the native heap: freed model memory would be reused now.
    for (int i = 0; i < 5; ++i) {
      try (Model other = Model.fromPreset("tiny", "f32", 100 + i)) {
        other.param(0).asFloatBuffer().put(0, 7f);
      }
    }
    assertEquals(before + 1, collectUntil(before + 1), "the views hold the closed model");
    for (int i = 0; i < weights.length; ++i) assertEquals(weights[i], view.get(i), "weight " + i);
    assertEquals(weights[2], slice.order(java.nio.ByteOrder.nativeOrder()).getFloat(0));
    for (int i = 0; i < view.capacity(); ++i) view.put(i, -1f);  // writes land in the model's own memory
    grad.putFloat(0, 3f);
    assertEquals(-1f, view.get(weights.length - 1));

    view = null;
    slice = null;
    grad = null;
    assertEquals(before, collectUntil(before), "the model is freed with its last view");
  }

  @Test
  void gradientViewsBlockLoraUntilDropped() throws Throwable {
    Path adapter = Files.createTempDirectory("seqgrad-java-views").resolve("adapter");
    try (Model donor = Model.fromPreset("tiny", "f64", 1)) {
      donor.enableLora(new LoraOptions().rank(2));
      donor.saveLoraAdapter(adapter.toString(), null);
    }
    Map<String, Function<Model, Executable>> enablers = Map.of(
        "Model.enableLora", m -> () -> m.enableLora(new LoraOptions().rank(2)),
        "Model.loadLoraAdapter", m -> () -> m.loadLoraAdapter(adapter.toString()));
    for (Map.Entry<String, Function<Model, Executable>> e : enablers.entrySet()) {
      try (Model m = Model.fromPreset("tiny", "f64", 1)) {
        DoubleBuffer param = m.param(3).asDoubleBuffer();
        double first = param.get(0);
        DoubleBuffer grad = m.grad(3).asDoubleBuffer();
        FailedPreconditionException refused =
            assertThrows(FailedPreconditionException.class, e.getValue().apply(m));
        assertTrue(refused.getMessage().startsWith(e.getKey() + ": 1 gradient view(s)"), refused.getMessage());
        assertNull(m.lora());
        assertEquals(0.0, grad.get(0));  // still the model's gradient memory

        grad = null;  // dropped: the next call collects it and enables LoRA
        e.getValue().apply(m).execute();
        assertEquals(2, m.lora().rank);
        assertNull(m.grad(3));  // the base parameters are frozen
        assertEquals(first, param.get(0));  // parameter views stay valid
      }
    }
  }

  @Test
  void forgottenModelsAndTrainersAreFreed() throws Exception {
    final int pairs = 350;  // the count: 174 MB held for good without Cleaners
    final int batch = 50;  // the Java heap does not see native memory: collect every batch to bound the peak
    Runnable forget = () -> {
      Model m = Model.fromPreset("tiny");
      Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8));
      t.setProgressListener((step, loss, tokens, gn, phase) -> {});
      m.grad(0).putFloat(0, 1f);
    };
    for (int i = 0; i < 10; ++i) {  // warm-up, stepping (gradients and optimizer state allocated)
      Trainer t = Trainer.create(Model.fromPreset("tiny"), new Trainer.Options().strategy("seco").chunk(8));
      t.step(List.of(A));
    }
    long live0 = settle();
    long perPair;  // what a pair holds while reachable (RSS measures it only where no freed memory is reused)
    try (Model m = Model.fromPreset("tiny")) {
      perPair = 2 * NativeApi.modelParamBytes(m.acquire());  // values and gradients; the moments come with a step
      m.release();
    }

    // Round 1 frees every pair (live handles), round 2 reuses that memory: RSS stays (it would grow by the leak).
    long[] rss = new long[2];
    for (int round = 0; round < 2; ++round) {
      for (int i = 0; i < pairs; ++i) {
        forget.run();
        if ((i + 1) % batch == 0) assertEquals(live0, collectUntil(live0), "native models/trainers left after GC");
      }
      rss[round] = rssBytes();
    }
    long grown = rss[1] - rss[0];
    System.out.printf("forgotten pairs: %d B each while reachable; RSS %+d B over %d more%n", perPair, grown, pairs);
    assertTrue(grown < pairs * perPair / 4, "RSS grew by " + grown + " B over " + pairs + " forgotten pairs");
  }

  /** The program: pairs forgotten without any call that collects garbage (1200 grew RSS by 549 MB). */
  @Test
  void forgottenHandlesAreFreedWithoutTheCallerCollecting() throws Exception {
    final int pairs = 600;
    long live0 = settle();
    long most = 0;
    for (int i = 0; i < pairs; ++i) {
      Model m = Model.fromPreset("tiny");
      Trainer.create(m, new Trainer.Options().strategy("seco").chunk(8).pageSize(8));
      most = Math.max(most, NativeApi.liveHandles() - live0);
    }
    System.out.printf("forgotten pairs: at most %d native handles alive over %d pairs%n", most, pairs);
    // A pair counts 4 x 115 KiB (values and gradients, two moments): a collection every 64 MiB, ~140 pairs.
    assertTrue(most < pairs, most + " of " + 2 * pairs + " handles were alive at once");
    assertEquals(live0, collectUntil(live0), "native models/trainers left after GC");
  }

  @Test
  void everyStatusCodeHasItsException() {
    int defined = 0;
    for (int code = 1; code <= 200; ++code) {
      String nativeName = NativeApi.codeName(code);
      SeqgradException e = SeqgradException.of(code, "m");
      assertEquals(code, e.getCode());
      assertEquals("m", e.getMessage());
      if (nativeName.equals("UNKNOWN_CODE")) {
        assertSame(SeqgradException.class, e.getClass(), "code " + code);
        assertEquals("CODE_" + code, e.getCodeName());
        continue;
      }
      ++defined;
      assertEquals(nativeName, e.getCodeName());
      // e.g. DATA_LOSS -> DataLossException
      String expected = Arrays.stream(nativeName.split("_"))
          .map(w -> w.charAt(0) + w.substring(1).toLowerCase()).reduce("", String::concat) + "Exception";
      assertEquals(expected, e.getClass().getSimpleName(), "code " + code);
    }
    assertEquals(17, defined);  // CANCELLED..UNAUTHENTICATED and BUSY
    assertEquals(SeqgradException.BUSY, new BusyException("x").getCode());
  }

  @Test
  void nullArgumentsNameTheArgument() throws Exception {
    try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
      Map<String, Executable> calls = Map.ofEntries(
          Map.entry("Trainer.create: model is null", () -> Trainer.create(null, new Trainer.Options())),
          Map.entry("Trainer.create: options is null", () -> Trainer.create(m, null)),
          Map.entry("Model.fromPreset: name is null", () -> Model.fromPreset(null)),
          Map.entry("Model.load: dir is null", () -> Model.load(null, "f32")),
          Map.entry("Model.save: dir is null", () -> m.save(null)),
          Map.entry("Model.enableLora: options is null", () -> m.enableLora(null)),
          Map.entry("Model.saveLoraAdapter: dir is null", () -> m.saveLoraAdapter(null, null)),
          Map.entry("Model.loadLoraAdapter: dir is null", () -> m.loadLoraAdapter(null)),
          Map.entry("Trainer.step: sequences is null", () -> t.step((List<int[]>) null)),
          Map.entry("Trainer.step: sequences[1] is null", () -> t.step(Arrays.asList(A, null))),
          Map.entry("Trainer.accumulateGradients: sequences is null", () -> t.accumulateGradients(null)),
          Map.entry("Trainer.score: sequences is null", () -> t.score(null, List.of(A))),
          Map.entry("Trainer.score: sequences[0] is null", () -> t.score(Arrays.asList((int[]) null), null)),
          Map.entry("Trainer.saveCheckpoint: outDir is null", () -> t.saveCheckpoint(null, 0, 0)),
          Map.entry("Trainer.loadCheckpoint: checkpointDir is null", () -> t.loadCheckpoint(null)),
          Map.entry("Trainer.resume: outDir is null", () -> t.resume(null, true)));
      for (Map.Entry<String, Executable> c : calls.entrySet()) {
        assertEquals(c.getKey(), assertThrows(InvalidArgumentException.class, c.getValue()).getMessage());
      }
      assertEquals(0, t.stepCount());
      assertNotNull(t.step(List.of(A)));
    }
  }

  @Test
  void versionIsTheJarsEverywhere() {
    assertEquals(Version.STRING, Model.version());
    assertEquals(Version.STRING, Version.MAJOR + "." + Version.MINOR + "." + Version.PATCH);
    assertNotEquals("", Version.STRING);
  }
}
