package org.seqgrad.examples;

import java.io.BufferedReader;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.stream.Stream;
import org.seqgrad.Metrics;
import org.seqgrad.Model;
import org.seqgrad.Trainer;

/**
 * A JVM pipeline: streams a JSONL file of {"input_ids": [...]} lines, groups them into batches and trains a model
 * on them with next-token labels, printing the loss of every step.
 *
 * <p>usage: JsonlTrain FILE.jsonl [epochs=3] [batch=4] [preset=tiny] [strategy=seco]
 */
public final class JsonlTrain {
  private static final Pattern IDS = Pattern.compile("\"input_ids\"\\s*:\\s*\\[([^\\]]*)\\]");

  static int[] parseLine(String line, long lineNo) {
    Matcher m = IDS.matcher(line);
    if (!m.find()) throw new IllegalArgumentException("line " + lineNo + ": no \"input_ids\" array");
    String body = m.group(1).trim();
    if (body.isEmpty()) return new int[0];
    String[] parts = body.split(",");
    int[] ids = new int[parts.length];
    for (int i = 0; i < parts.length; ++i) ids[i] = Integer.parseInt(parts[i].trim());
    return ids;
  }

  public static void main(String[] args) throws IOException {
    if (args.length < 1) {
      System.err.println("usage: JsonlTrain FILE.jsonl [epochs] [batch] [preset] [strategy]");
      System.exit(2);
    }
    final int epochs = args.length > 1 ? Integer.parseInt(args[1]) : 3;
    final int batchSize = args.length > 2 ? Integer.parseInt(args[2]) : 4;
    final String preset = args.length > 3 ? args[3] : "tiny";
    final String strategy = args.length > 4 ? args[4] : "seco";
    System.out.println("seqgrad " + Model.version() + ", preset " + preset + ", strategy " + strategy);
    try (Model model = Model.fromPreset(preset, "f32", 0);
         Trainer trainer = Trainer.create(model, new Trainer.Options().strategy(strategy).chunk(16).pageSize(16)
             .lr(3e-3))) {
      for (int epoch = 1; epoch <= epochs; ++epoch) {
        long[] lineNo = {0};
        // The file is read lazily, line by line; only one batch is held at a time.
        try (BufferedReader r = Files.newBufferedReader(Paths.get(args[0]), StandardCharsets.UTF_8);
             Stream<String> lines = r.lines()) {
          Iterator<int[]> seqs = lines.filter(l -> !l.isBlank())
              .map(l -> parseLine(l, ++lineNo[0])).iterator();
          List<int[]> batch = new ArrayList<>();
          while (seqs.hasNext()) {
            batch.add(seqs.next());
            if (batch.size() == batchSize || !seqs.hasNext()) {
              Metrics m = trainer.step(batch);
              System.out.printf("epoch %d step %d loss %.4f tokens %d peak %d bytes%n", epoch, m.step, m.loss,
                  m.tokens, m.peakBytes);
              batch.clear();
            }
          }
        }
      }
    }
  }
}
