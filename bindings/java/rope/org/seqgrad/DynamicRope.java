package org.seqgrad;

import java.nio.ByteBuffer;
import java.nio.DoubleBuffer;

/**
 * Run by dynamic_rope_test.py: prints, per sequence given, {@link Trainer#computeGradients}' loss and every gradient of
 * the model at args[0] in f64 (seco, chunk 7) as one JSON line {"loss": L, "grads": {"name": [...], ...}}, which the
 * test compares with transformers. Arguments: MODEL_DIR IDS... (each IDS comma-separated token ids).
 */
public final class DynamicRope {
  public static void main(String[] args) {
    try (Model model = Model.load(args[0], "f64");
        Trainer trainer = Trainer.create(model, new Trainer.Options().strategy("seco").chunk(7))) {
      for (int a = 1; a < args.length; ++a) {
        String[] tokens = args[a].split(",");
        int[] ids = new int[tokens.length];
        for (int i = 0; i < ids.length; ++i) ids[i] = Integer.parseInt(tokens[i]);
        Metrics m = trainer.computeGradients(ids, null, new long[] {ids.length});
        StringBuilder line = new StringBuilder("{\"loss\": ").append(m.loss).append(", \"grads\": {");
        for (int i = 0; i < model.numParams(); ++i) {
          ByteBuffer grad = model.grad(i);
          DoubleBuffer values = grad.asDoubleBuffer();
          line.append(i > 0 ? ", " : "").append('"').append(model.paramName(i)).append("\": [");
          for (int k = 0; k < values.limit(); ++k) line.append(k > 0 ? ", " : "").append(values.get(k));
          line.append(']');
        }
        System.out.println(line.append("}}"));
      }
    }
  }
}
