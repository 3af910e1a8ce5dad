package org.seqgrad.e2e;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.seqgrad.LoraOptions;
import org.seqgrad.Metrics;
import org.seqgrad.Model;
import org.seqgrad.Trainer;

/**
 * The Java pipeline of the end-to-end example: LoRA on a Hugging Face model directory from the JSONL that {@code
 * python -m seqgrad.data} writes ({"input_ids": [...], "labels": [...]} per line, Hugging Face labels; packed records
 * also "doc_lengths", trained as their documents), one record per step in file order (cycling), then the PEFT adapter
 * and the trained model's loss over every record.
 *
 * <p>usage: LoraTrain MODEL_DIR DATA.jsonl ADAPTER_OUT [--steps=8] [--strategy=seco] [--chunk=128] [--lr=1e-2]
 * [--lora-rank=8] [--lora-alpha=16] [--lora-targets=all]
 */
public final class LoraTrain {
  private static final List<String> FLAGS =
      List.of("--steps", "--strategy", "--chunk", "--lr", "--lora-rank", "--lora-alpha", "--lora-targets");

  private static void usage(String error) {
    System.err.println("error: " + error);
    System.err.println("usage: LoraTrain MODEL_DIR DATA.jsonl ADAPTER_OUT [--flag=value ...]; flags: "
        + String.join(", ", FLAGS));
    System.exit(2);
  }

  /** The flag's value as a number (its default when absent); anything else stops with the flag named. */
  private static double number(Map<String, String> flags, String name, double byDefault) {
    String v = flags.get(name);
    if (v == null) return byDefault;
    try {
      return Double.parseDouble(v);
    } catch (NumberFormatException e) {
      usage(name + "=" + v + " is not a number");
      return 0;
    }
  }

  /** One record: its token ids, Hugging Face labels and, when packed, its documents' lengths (else null). */
  record Sequence(int[] ids, int[] labels, long[] docLengths) {}

  private static int[] intArray(String line, String field, String where) {
    Matcher m = Pattern.compile("\"" + field + "\"\\s*:\\s*\\[([^\\]]*)\\]").matcher(line);
    if (!m.find()) throw new IllegalArgumentException(where + ": no \"" + field + "\" array");
    String body = m.group(1).trim();
    if (body.isEmpty()) return new int[0];
    String[] parts = body.split(",");
    int[] out = new int[parts.length];
    for (int i = 0; i < parts.length; ++i) {
      try {
        out[i] = Integer.parseInt(parts[i].trim());
      } catch (NumberFormatException e) {
        throw new IllegalArgumentException(where + ": field \"" + field + "\" has a non-integer '" + parts[i].trim()
            + "'");
      }
    }
    return out;
  }

  static List<Sequence> read(String path) throws IOException {
    List<Sequence> out = new ArrayList<>();
    List<String> lines = Files.readAllLines(Paths.get(path), StandardCharsets.UTF_8);
    for (int i = 0; i < lines.size(); ++i) {
      if (lines.get(i).isBlank()) continue;
      String where = path + ":" + (i + 1);
      long[] docs = null;
      if (lines.get(i).contains("\"doc_lengths\"")) {
        docs = java.util.Arrays.stream(intArray(lines.get(i), "doc_lengths", where)).asLongStream().toArray();
      }
      Sequence s = new Sequence(intArray(lines.get(i), "input_ids", where), intArray(lines.get(i), "labels", where),
          docs);
      if (s.ids.length != s.labels.length) {
        throw new IllegalArgumentException(where + ": " + s.ids.length + " input_ids but " + s.labels.length
            + " labels");
      }
      out.add(s);
    }
    if (out.isEmpty()) throw new IllegalArgumentException(path + ": no records");
    return out;
  }

  public static void main(String[] args) throws IOException {
    if (args.length < 3) usage("MODEL_DIR, DATA.jsonl and ADAPTER_OUT come first");
    Map<String, String> flags = new HashMap<>();
    for (String a : List.of(args).subList(3, args.length)) {
      String[] nameValue = a.split("=", 2);
      if (nameValue.length != 2 || !FLAGS.contains(nameValue[0])) usage("not a flag=value of this tool: " + a);
      flags.put(nameValue[0], nameValue[1]);
    }
    String modelDir = args[0];
    List<Sequence> data = read(args[1]);
    long steps = (long) number(flags, "--steps", 8);
    long rank = (long) number(flags, "--lora-rank", 8);

    try (Model model = Model.load(modelDir, "f32")) {
      model.enableLora(new LoraOptions().rank(rank)
          .alpha(number(flags, "--lora-alpha", 2 * rank))
          .targets(flags.getOrDefault("--lora-targets", "all")));
      Trainer.Options options = new Trainer.Options().strategy(flags.getOrDefault("--strategy", "seco"))
          .chunk((long) number(flags, "--chunk", 128))
          .lr(number(flags, "--lr", 1e-2));
      try (Trainer trainer = Trainer.create(model, options)) {
        for (long step = 0; step < steps; ++step) {
          Sequence s = data.get((int) (step % data.size()));
          Metrics m = trainer.step(s.ids, s.labels, new long[] {s.ids.length}, new long[][] {s.docLengths});
          System.out.printf("step %d loss %.6f tokens %d chunks %d peak %d bytes%n", m.step, m.loss, m.tokens,
              m.chunks, m.peakBytes);
        }
        // Every record in one batch: the mean over all their labelled tokens, as peft_check.py computes it.
        int total = data.stream().mapToInt(s -> s.ids.length).sum();
        int[] ids = new int[total];
        int[] labels = new int[total];
        long[] lengths = new long[data.size()];
        long[][] docLengths = new long[data.size()][];
        int at = 0;
        for (int i = 0; i < data.size(); ++i) {
          Sequence s = data.get(i);
          System.arraycopy(s.ids, 0, ids, at, s.ids.length);
          System.arraycopy(s.labels, 0, labels, at, s.labels.length);
          lengths[i] = s.ids.length;
          docLengths[i] = s.docLengths;
          at += s.ids.length;
        }
        System.out.printf("eval loss %.17g%n", trainer.evaluate(ids, labels, lengths, docLengths).loss);
      }
      model.saveLoraAdapter(args[2], modelDir);
      System.out.println("wrote " + args[2]);
    }
  }
}
