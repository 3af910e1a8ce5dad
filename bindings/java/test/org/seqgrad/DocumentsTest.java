package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.api.Test;

/** 0.8: sequences packing documents (docLengths) train as their documents alone; bad lengths are named. */
class DocumentsTest {
  static final int[] IDS = ScoreTest.IDS;  // documents A (24 tokens) and B (16), packed into one sequence
  static final long[] ONE = {IDS.length};
  static final long[][] DOCS = {{ScoreTest.A.length, ScoreTest.B.length}};

  @Test
  void packedDocumentsEqualTheDocumentsAsSequences() {
    try (Model m = Model.fromPreset("tiny", "f64", 2); Trainer t = Trainer.create(m, ScoreTest.seco())) {
      Metrics alone = t.computeGradients(IDS, null, ScoreTest.LENGTHS);
      double[] gAlone = SeqgradTest.grads64(m);
      Metrics packed = t.computeGradients(IDS, null, ONE, DOCS);
      double[] gPacked = SeqgradTest.grads64(m);
      assertEquals(alone.tokens, packed.tokens);
      assertEquals(alone.loss, packed.loss, 1e-13 * alone.loss);
      double diff = 0, scale = 0;
      for (int i = 0; i < gAlone.length; ++i) {
        diff = Math.max(diff, Math.abs(gAlone[i] - gPacked[i]));
        scale = Math.max(scale, Math.abs(gAlone[i]));
      }
      assertTrue(scale > 0 && diff <= 1e-11 * scale, "gradients differ by " + diff + " of " + scale);
      double[] lpAlone = t.score(IDS, null, ScoreTest.LENGTHS);
      double[] lpPacked = t.score(IDS, null, ONE, DOCS);
      for (int i = 0; i < IDS.length; ++i) {
        assertEquals(Double.isNaN(lpAlone[i]), Double.isNaN(lpPacked[i]), "position " + i);
        if (!Double.isNaN(lpAlone[i])) assertEquals(lpAlone[i], lpPacked[i], 1e-12 * Math.abs(lpAlone[i]));
      }
      assertEquals(alone.loss, t.evaluate(IDS, null, ONE, DOCS).loss, 1e-13 * alone.loss);
      assertEquals(alone.loss, t.evaluateDetailed(IDS, null, ONE, null, DOCS).loss, 1e-13 * alone.loss);
      // A null entry: one document, attending across.
      assertEquals(IDS.length - 1, t.evaluate(IDS, null, ONE, new long[][] {null}).tokens);
    }
  }

  @Test
  void badDocumentLengthsAreNamed() {
    try (Model m = Model.fromPreset("tiny", "f64", 2); Trainer t = Trainer.create(m, ScoreTest.seco())) {
      InvalidArgumentException e = assertThrows(InvalidArgumentException.class,
          () -> t.step(IDS, null, ONE, new long[][] {{24, 0, 16}}));
      assertTrue(e.getMessage().contains("doc_lengths[0][1] = 0"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.step(IDS, null, ONE, new long[][] {{24}, {16}}));
      assertTrue(e.getMessage().contains("docLengths has 2 entries but lengths has 1"), e.getMessage());
      e = assertThrows(InvalidArgumentException.class, () -> t.step(IDS, null, ONE, new long[][] {{24, 15}}));
      assertTrue(e.getMessage().contains("doc_lengths[0] sums to 39 but lengths[0] is 40"), e.getMessage());
      assertEquals(0, t.stepCount());
    }
  }
}
