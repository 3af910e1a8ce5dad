package org.seqgrad;

import java.util.List;

/**
 * Run on each rank of mpirun -np 2 by tp_test.sh, from the jar alone (its libseqgrad_mpi.so): a tp = 2 trainer on
 * "demo" in fp64 gives one process's losses within 1e-12 relative and reports the split; bad tp values throw on every
 * rank with the numbers.
 */
public final class TensorParallelMain {
  public static void main(String[] args) {
    String rank = System.getenv().getOrDefault("OMPI_COMM_WORLD_RANK", "0");
    int[] seq = new int[40];
    for (int i = 0; i < seq.length; ++i) seq[i] = (i * 37 + 11) % 128;
    try (Model a = Model.fromPreset("demo", "f64", 7); Model b = Model.fromPreset("demo", "f64", 7);
        Model tiny = Model.fromPreset("tiny", "f64", 7)) {
      Trainer.Options o = new Trainer.Options().strategy("seco").chunk(16).pageSize(8).lr(1e-2);
      try (Trainer one = Trainer.create(a, o); Trainer tp = Trainer.create(b, o.tp(2))) {
        for (int s = 1; s <= 3; ++s) {
          Metrics x = one.step(List.of(seq)), y = tp.step(List.of(seq));
          System.out.printf("rank %s step %d: one process %.17g, tp=2 %.17g%n", rank, s, x.loss, y.loss);
          check(Math.abs(x.loss - y.loss) <= 1e-12 * x.loss, "losses differ");
          check(y.tp == 2 && y.tpBytesReduced > 0 && x.tp == 1, "metrics tp " + y.tp + ", " + y.tpBytesReduced);
          check(2 * y.peakBytesByCategory[4] == x.peakBytesByCategory[4], "kv_cache is not half one process's");
        }
      }
      expect(InvalidArgumentException.class, "options->tp = 3: the job has 2 ranks, which is not tp (3)",
          () -> Trainer.create(a, new Trainer.Options().tp(3)));
      expect(InvalidArgumentException.class, "vocab_size=97 is not divisible by 2",
          () -> Trainer.create(tiny, new Trainer.Options().tp(2)));
    }
    System.out.println("rank " + rank + ": PASS");
  }

  private static void expect(Class<? extends SeqgradException> kind, String text, Runnable call) {
    try {
      call.run();
    } catch (SeqgradException e) {
      check(kind.isInstance(e) && e.getMessage().contains(text), "got " + e);
      System.out.println("refused as expected: " + e.getMessage());
      return;
    }
    check(false, "accepted; expected " + kind.getSimpleName() + " containing " + text);
  }

  private static void check(boolean ok, String what) {
    if (!ok) throw new AssertionError(what);
  }
}
