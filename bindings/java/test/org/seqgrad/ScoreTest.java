package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import org.junit.jupiter.api.Test;

/** 0.7: Hugging Face's labels, per-token log-probs (Trainer.score) and the thread count. */
class ScoreTest {
  static final int[] A = SeqgradTest.A;
  static final int[] B = SeqgradTest.B;
  static final int[] IDS = SeqgradTest.concat(A, B);
  static final long[] LENGTHS = {A.length, B.length};

  static Trainer.Options seco() {
    return new Trainer.Options().strategy("seco").chunk(8).pageSize(8);
  }

  /** Hugging Face labels over IDS: some masked (-100), the others arbitrary tokens of the vocabulary. */
  static int[] someLabels() {
    int[] labels = new int[IDS.length];
    for (int i = 0; i < IDS.length; ++i) labels[i] = i % 5 == 2 ? -100 : IDS[(i * 3) % IDS.length];
    return labels;
  }

  /** A sequence's first position or a -100 label: no log-prob there. */
  static boolean unlabelled(int i, int[] labels) {
    return i == 0 || i == A.length || labels[i] == -100;
  }

  @Test
  void labelsAreAlignedWithIdsAndShiftedByTheLibrary() {
    try (Model m = Model.fromPreset("tiny", "f64", 2); Trainer t = Trainer.create(m, seco())) {
      Metrics next = t.computeGradients(IDS, null, LENGTHS);
      double[] gNext = SeqgradTest.grads64(m);
      Metrics same = t.computeGradients(IDS, IDS.clone(), LENGTHS);  // labels = ids: next-token labels
      assertEquals(next.loss, same.loss);
      assertEquals(IDS.length - 2, same.tokens);  // each sequence's first token is never predicted
      assertArrayEquals(gNext, SeqgradTest.grads64(m));
      // Labels shifted by the caller as before 0.7 (target of position t at t) train something else.
      int[] preshifted = new int[IDS.length];
      for (int i = 0; i < IDS.length; ++i) {
        preshifted[i] = i + 1 < IDS.length && i + 1 != A.length ? IDS[i + 1] : -100;
      }
      assertTrue(Math.abs(t.evaluate(IDS, preshifted, LENGTHS).loss - next.loss) > 1e-3);
      // A 10-token prompt per sequence: only the tokens after it are learned.
      int[] masked = IDS.clone();
      for (int i = 0; i < IDS.length; ++i) {
        if ((i < A.length ? i : i - A.length) < 10) masked[i] = -100;
      }
      assertEquals((A.length - 10) + (B.length - 10), t.evaluate(IDS, masked, LENGTHS).tokens);
    }
  }

  @Test
  void scoreIsTheLossPerTokenForBothFamilies() {
    int[] labels = someLabels();
    for (String preset : List.of("tiny", "tiny-ssm")) {
      try (Model m = Model.fromPreset(preset, "f64", 2); Trainer t = Trainer.create(m, seco())) {
        t.computeGradients(IDS, null, LENGTHS);
        double[] grads = SeqgradTest.grads64(m);
        double[] lp = t.score(IDS, labels, LENGTHS);
        assertEquals(IDS.length, lp.length);
        double sum = 0;
        int labelled = 0;
        for (int i = 0; i < lp.length; ++i) {
          if (unlabelled(i, labels)) {
            assertTrue(Double.isNaN(lp[i]), preset + " position " + i + ": " + lp[i]);
          } else {
            assertTrue(Double.isFinite(lp[i]) && lp[i] < 0, preset + " position " + i + ": " + lp[i]);
            sum += lp[i];
            ++labelled;
          }
        }
        Metrics e = t.evaluate(IDS, labels, LENGTHS);
        assertEquals(e.tokens, labelled, preset);
        assertEquals(e.loss, -sum / labelled, 1e-12 * e.loss, preset);
        assertArrayEquals(grads, SeqgradTest.grads64(m), preset + ": gradients untouched");
        assertEquals(0, t.stepCount());

        // Entry t is log p(labels[t] | ids[0..t)): changing ids[k] changes entries after k only, in its sequence.
        for (int k = 3; k < A.length - 1; k += 7) {
          int[] ids2 = IDS.clone();
          ids2[k] = (IDS[k] + 1) % 50;
          double[] lp2 = t.score(ids2, labels, LENGTHS);
          for (int i = 0; i < lp.length; ++i) {
            if (i <= k || i >= A.length) {
              assertEquals(lp[i], lp2[i], preset + ": ids[" + k + "] changed entry " + i);  // NaN equals NaN
            }
          }
          assertTrue(labels[k + 1] == -100 || Math.abs(lp2[k + 1] - lp[k + 1]) > 1e-9, preset + " k " + k);
        }

        // Per sequence; null labels = ids; no label at all: all NaN.
        List<double[]> perSeq = t.score(List.of(A, B),
            List.of(Arrays.copyOfRange(labels, 0, A.length), Arrays.copyOfRange(labels, A.length, IDS.length)));
        assertArrayEquals(Arrays.copyOfRange(lp, 0, A.length), perSeq.get(0));
        assertArrayEquals(Arrays.copyOfRange(lp, A.length, IDS.length), perSeq.get(1));
        double[] next = t.score(IDS, null, LENGTHS);
        assertArrayEquals(t.score(IDS, IDS.clone(), LENGTHS), next);
        List<double[]> nextSeq = t.score(List.of(A, B), null);
        assertArrayEquals(Arrays.copyOfRange(next, A.length, IDS.length), nextSeq.get(1));
        assertArrayEquals(nextSeq.get(0), t.score(List.of(A, B), Arrays.asList(null, B)).get(0));
        int[] none = new int[IDS.length];
        Arrays.fill(none, -100);
        for (double x : t.score(IDS, none, LENGTHS)) assertTrue(Double.isNaN(x));
      }
    }
  }

  @Test
  void scoreErrorsNameTheArgument() {
    try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
      InvalidArgumentException e = assertThrows(InvalidArgumentException.class,
          () -> t.score(IDS, new int[3], LENGTHS));
      assertTrue(e.getMessage().contains("labels has 3 entries but ids has 40"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.score(IDS, null, null));
      assertTrue(e.getMessage().contains("'lengths'"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.score(IDS, null, new long[] {24}));
      assertTrue(e.getMessage().contains("lengths"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.score(new int[] {1, 97}, null, new long[] {2}));
      assertTrue(e.getMessage().contains("ids[1] = 97"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.score(List.of(A, B), List.of(A)));
      assertTrue(e.getMessage().contains("Trainer.score: labels has 1 entries but sequences has 2"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.score(List.of(A, B), List.of(A, A)));
      assertTrue(e.getMessage().contains("labels[1] has 24 entries but sequences[1] has 16"), e.getMessage());
      t.close();
      assertThrows(IllegalStateException.class, () -> t.score(IDS, null, LENGTHS));
    }
  }

  /** GRPO completions: SeqgradTest's prompt + response shapes, log-probs from the given lists (null: none). */
  static List<List<GrpoCompletion>> groups(List<double[]> old, List<double[]> ref) {
    int[] sizes = {3, 2};
    double[] advantages = {1.0, -0.5, 0.5, 2.0, 0.3};
    List<List<GrpoCompletion>> out = new ArrayList<>();
    int c = 0;
    for (int g = 0; g < sizes.length; ++g) {
      List<GrpoCompletion> group = new ArrayList<>();
      for (int i = 0; i < sizes[g]; ++i, ++c) {
        int[][] s = SeqgradTest.promptResponse(18 - 3 * i + g, 4, 3 * g + i);
        group.add(new GrpoCompletion(s[0], s[1], advantages[c], old == null ? null : old.get(c),
            ref == null ? null : ref.get(c)));
      }
      out.add(group);
    }
    return out;
  }

  /** Each completion's log-probs under the model of t, one score call per completion. */
  static List<double[]> scoreCompletions(Trainer t) {
    List<double[]> out = new ArrayList<>();
    for (List<GrpoCompletion> group : groups(null, null)) {
      for (GrpoCompletion c : group) out.add(t.score(c.ids, c.labels, new long[] {c.ids.length}));
    }
    return out;
  }

  @Test
  void grpoWithScoredLogprobsEqualsReferenceModel() {
    try (Model policy = Model.fromPreset("tiny", "f64", 3); Model reference = Model.fromPreset("tiny", "f64", 5)) {
      List<double[]> ref, old;
      try (Trainer r = Trainer.create(reference, seco()); Trainer p = Trainer.create(policy, seco())) {
        ref = scoreCompletions(r);
        old = scoreCompletions(p);  // the current policy: ratio 1, as without old log-probs
      }
      Trainer.Options o = seco().pageSize(4).objective("grpo").grpoKlBeta(0.5).reference(reference);
      try (Trainer t = Trainer.create(policy, o)) {
        Metrics viaModel = t.computeGradientsGrpo(groups(null, null));
        double[] gModel = SeqgradTest.grads64(policy);
        Metrics given = t.computeGradientsGrpo(groups(old, ref));
        double[] gGiven = SeqgradTest.grads64(policy);
        assertTrue(Double.isFinite(viaModel.loss));
        assertEquals(viaModel.loss, given.loss, 1e-12 * Math.abs(viaModel.loss));
        assertEquals(gModel.length, gGiven.length);
        for (int i = 0; i < gModel.length; ++i) assertEquals(gModel[i], gGiven[i], 1e-12, "gradient " + i);
        // Aligned as before 0.7 (entry t for the label of position t + 1) they give another loss.
        List<double[]> shifted = new ArrayList<>();
        for (double[] lp : ref) {
          double[] s = new double[lp.length];
          for (int i = 0; i < lp.length; ++i) s[i] = i + 1 < lp.length ? lp[i + 1] : -1.0;
          shifted.add(s);
        }
        assertTrue(Math.abs(t.computeGradientsGrpo(groups(null, shifted)).loss - viaModel.loss) > 1e-6);
      }
    }
  }

  /**
   * Threads of this process named as the calling thread: OpenMP's workers inherit the name of the thread that
   * created them, the JVM's own threads have their own names.
   */
  static long threadsNamedLikeThisOne() throws Exception {
    String self = Files.readString(Path.of("/proc/thread-self/comm"));
    long n = 0;
    try (DirectoryStream<Path> tasks = Files.newDirectoryStream(Path.of("/proc/self/task"))) {
      for (Path task : tasks) {
        try {
          if (Files.readString(task.resolve("comm")).equals(self)) ++n;
        } catch (NoSuchFileException gone) {
          // a thread that ended meanwhile
        }
      }
    }
    return n;
  }

  @Test
  void numThreadsSetsTheEngineThreadsAndRejectsNegatives() throws Exception {
    // More threads than the default (one per core): the engine's OpenMP pool grows to that many on this thread.
    int many = Runtime.getRuntime().availableProcessors() + 3;
    double[] losses = new double[2];
    double[][] grads = new double[2][];
    for (int k = 0; k < 2; ++k) {
      try (Model m = Model.fromPreset("tiny", "f64", 8);
           Trainer t = Trainer.create(m, seco().numThreads(k == 0 ? 1 : many))) {
        long before = threadsNamedLikeThisOne();
        losses[k] = t.computeGradients(IDS, null, LENGTHS).loss;
        grads[k] = SeqgradTest.grads64(m);
        if (k == 1) {
          long added = threadsNamedLikeThisOne() - before;
          assertTrue(added >= 3, "numThreads(" + many + ") started " + added + " OpenMP threads");
        }
      }
    }
    assertEquals(losses[0], losses[1], 1e-12 * losses[0]);  // reductions split differently: equal to rounding
    for (int i = 0; i < grads[0].length; ++i) {
      assertEquals(grads[0][i], grads[1][i], 1e-10 * (Math.abs(grads[0][i]) + 1e-3), "gradient " + i);
    }
    assertEquals(0, new Trainer.Options().numThreads);
    try (Model m = Model.fromPreset("tiny")) {
      InvalidArgumentException e =
          assertThrows(InvalidArgumentException.class, () -> Trainer.create(m, seco().numThreads(-1)));
      assertEquals(SeqgradException.INVALID_ARGUMENT, e.getCode());
      assertTrue(e.getMessage().contains("options->num_threads is -1"), e.getMessage());
    }
  }
}
