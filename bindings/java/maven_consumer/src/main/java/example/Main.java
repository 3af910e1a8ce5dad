package example;

import java.util.List;
import org.seqgrad.Model;
import org.seqgrad.Trainer;

/** Trains a tiny model one step with seqgrad from a Maven repository and prints the loss (maven_repo_test). */
public final class Main {
  public static void main(String[] args) {
    try (Model model = Model.fromPreset("tiny"); Trainer trainer = Trainer.create(model, new Trainer.Options())) {
      double loss = trainer.step(List.of(new int[] {1, 2, 3, 4, 5, 6, 7, 8})).loss;
      if (!(Double.isFinite(loss) && loss > 0)) throw new AssertionError("loss " + loss);
      System.out.println("loss " + loss);
    }
  }
}
