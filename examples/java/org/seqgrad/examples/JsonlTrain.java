package org.seqgrad.examples;

import java.io.BufferedReader;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.stream.Stream;
import org.seqgrad.CheckpointState;
import org.seqgrad.LoraOptions;
import org.seqgrad.Metrics;
import org.seqgrad.Model;
import org.seqgrad.Trainer;

/**
 * A JVM pipeline: streams a JSONL file of {"input_ids": [...], "labels": [...]} lines, groups them into batches and
 * trains a model on them, printing the loss of every step.
 *
 * <p>The file is what examples:train --data reads: "labels" is optional and follows Hugging Face's convention (aligned
 * with input_ids and as long, unshifted, -100 = no loss; the library shifts them, so a record's first label is never
 * predicted), and a record without it is trained on next-token labels. Labels are passed to the trainer as they are.
 *
 * <p>usage: JsonlTrain FILE.jsonl [epochs=3] [batch=4] [model=tiny] [strategy=seco] [--flag=value ...]
 *
 * <p>model: a built-in preset or a Hugging Face model directory (config.json + model.safetensors, Llama/Qwen2/Mamba),
 * e.g. the one whose tokenizer prepared FILE.jsonl ({@code python -m seqgrad.data}).
 *
 * <p>Flags (since 0.5):
 *
 * <ul>
 *   <li>--lora-rank=R (0 = full fine-tuning), --lora-alpha=A (default 2R), --lora-dropout=P, --lora-targets=q_proj,...:
 *       train LoRA adapters with the base frozen
 *   <li>--lr=LR, --lr-schedule=constant|cosine|linear, --warmup-steps=W, --min-lr=M: the schedule decays over all the
 *       run's steps
 *   <li>--grad-accum=K: K micro-batches of `batch` records per optimizer step
 *   <li>--out-dir=DIR, --save-every=N (steps; 0 = only the last), --keep=K (0 = all): checkpoints DIR/checkpoint-STEP
 *       and, at the end, DIR/adapter (PEFT files, with LoRA) or DIR/model (a Hugging Face model)
 *   <li>--resume: continue from the newest checkpoint in --out-dir (the records before its data position are
 *       skipped), with the losses an uninterrupted run would print
 *   <li>--stop-at-step=S: stop after step S (checkpointed), e.g. to resume later; --dtype=f32|f64; --seed=N
 *   <li>--seq-len=N: records longer than N + 1 tokens are cut to N + 1 (N predicted tokens, as train --seq_len=N
 *       --overlong=truncate); the count of cut records is printed. --chunk=N: tokens per chunk and KV page of the
 *       strategy (default 16)
 *   <li>--threads=N: the engine's threads (0 = OMP_NUM_THREADS, else one per core). On a machine shared with other
 *       processes, start the JVM with OMP_WAIT_POLICY=PASSIVE in its environment.
 * </ul>
 */
public final class JsonlTrain {
  /** One line of the file: its token ids and labels (null: next-token labels). */
  record Record(int[] ids, int[] labels) {}

  private static final Pattern IDS = arrayField("input_ids"), LABELS = arrayField("labels");

  private static Pattern arrayField(String name) {
    return Pattern.compile("\"" + name + "\"\\s*:\\s*\\[([^\\]]*)\\]");
  }

  /** The integers of an array field of a JSON line, or null when the line has no such field. */
  static int[] intArray(String line, Pattern field, String name, String where) {
    Matcher m = field.matcher(line);
    if (!m.find()) return null;
    String body = m.group(1).trim();
    if (body.isEmpty()) return new int[0];
    String[] parts = body.split(",");
    int[] values = new int[parts.length];
    for (int i = 0; i < parts.length; ++i) {
      try {
        values[i] = Integer.parseInt(parts[i].trim());
      } catch (NumberFormatException e) {
        throw new IllegalArgumentException(where + ": field '" + name + "' holds '" + parts[i].trim()
            + "', not an integer");
      }
    }
    return values;
  }

  static Record parseLine(String line, String where) {
    int[] ids = intArray(line, IDS, "input_ids", where);
    if (ids == null) throw new IllegalArgumentException(where + ": no \"input_ids\" array");
    int[] labels = intArray(line, LABELS, "labels", where);
    if (labels != null) {
      if (labels.length != ids.length) {
        throw new IllegalArgumentException(where + ": 'labels' has " + labels.length + " entries but 'input_ids' has "
            + ids.length + " (Hugging Face's labels are aligned with input_ids)");
      }
      for (int label : labels) {
        if (label < 0 && label != -100) {
          throw new IllegalArgumentException(where + ": 'labels' holds " + label + "; need -100 or a token id");
        }
      }
    }
    return new Record(ids, labels);
  }

  /** The first n tokens of a record. */
  static Record cut(Record r, int n) {
    if (r.ids().length <= n) return r;
    return new Record(Arrays.copyOf(r.ids(), n), r.labels() == null ? null : Arrays.copyOf(r.labels(), n));
  }

  private static final List<String> FLAGS = List.of("lora-rank", "lora-alpha", "lora-dropout", "lora-targets", "lr",
      "lr-schedule", "warmup-steps", "min-lr", "grad-accum", "out-dir", "save-every", "keep", "resume",
      "stop-at-step", "dtype", "seed", "threads", "seq-len", "chunk");

  private static void usage(String error) {
    System.err.println("error: " + error);
    System.err.println("usage: JsonlTrain FILE.jsonl [epochs] [batch] [model] [strategy] [--flag=value ...]; flags: --"
        + String.join(", --", FLAGS));
    System.exit(2);
  }

  /** The records of the file (lazily, one line at a time; blank lines skipped). */
  static Stream<Record> records(BufferedReader r, String file) {
    long[] lineNo = {0};
    return r.lines().map(l -> {
      ++lineNo[0];
      return l.isBlank() ? null : parseLine(l, file + ":" + lineNo[0]);
    }).filter(Objects::nonNull);
  }

  public static void main(String[] args) throws IOException {
    try {
      run(args);
    } catch (IllegalArgumentException e) {  // bad data or flag values (the library's errors are subclasses too)
      System.err.println("error: " + e.getMessage());
      System.exit(1);
    }
  }

  static void run(String[] args) throws IOException {
    List<String> positional = new ArrayList<>();
    Map<String, String> flags = new HashMap<>();
    for (String a : args) {
      if (!a.startsWith("--")) {
        positional.add(a);
        continue;
      }
      int eq = a.indexOf('=');
      String name = eq < 0 ? a.substring(2) : a.substring(2, eq);
      if (!FLAGS.contains(name)) usage("unknown flag --" + name);
      flags.put(name, eq < 0 ? "true" : a.substring(eq + 1));
    }
    if (positional.isEmpty()) usage("no FILE.jsonl");
    final String file = positional.get(0);
    final int epochs = positional.size() > 1 ? Integer.parseInt(positional.get(1)) : 3;
    final int batchSize = positional.size() > 2 ? Integer.parseInt(positional.get(2)) : 4;
    final String modelName = positional.size() > 3 ? positional.get(3) : "tiny";
    final String strategy = positional.size() > 4 ? positional.get(4) : "seco";
    final long loraRank = Long.parseLong(flags.getOrDefault("lora-rank", "0"));
    final long gradAccum = Long.parseLong(flags.getOrDefault("grad-accum", "1"));
    final String outDir = flags.get("out-dir");
    final long saveEvery = Long.parseLong(flags.getOrDefault("save-every", "0"));
    final int keep = Integer.parseInt(flags.getOrDefault("keep", "0"));
    final boolean resume = Boolean.parseBoolean(flags.getOrDefault("resume", "false"));
    final long stopAtStep = Long.parseLong(flags.getOrDefault("stop-at-step", "0"));
    if ((resume || saveEvery > 0) && outDir == null) usage("--resume and --save-every need --out-dir");
    final long seqLen = Long.parseLong(flags.getOrDefault("seq-len", "0"));
    if (seqLen < 0 || seqLen >= Integer.MAX_VALUE) usage("--seq-len must be in [0, 2^31 - 1)");
    final int maxTokens = seqLen > 0 ? (int) seqLen + 1 : Integer.MAX_VALUE;
    final long chunk = Long.parseLong(flags.getOrDefault("chunk", "16"));

    // The schedule's horizon: the steps of the whole run (one cheap pass counting the records).
    long records = 0, longer = 0;
    try (BufferedReader r = Files.newBufferedReader(Paths.get(file), StandardCharsets.UTF_8);
         Stream<Record> s = records(r, file)) {
      for (Iterator<Record> it = s.iterator(); it.hasNext(); ++records) {
        if (it.next().ids().length > maxTokens) ++longer;
      }
    }
    if (longer > 0) {
      System.out.println(longer + " of " + records + " records longer than --seq-len + 1 = " + maxTokens
          + " tokens: cut to that");
    }
    final long microBatches = (records + batchSize - 1) / batchSize;
    final long stepsPerEpoch = (microBatches + gradAccum - 1) / gradAccum;
    final long totalSteps = epochs * stepsPerEpoch;
    final long lastStep = stopAtStep > 0 ? Math.min(stopAtStep, totalSteps) : totalSteps;

    final boolean fromDir = Files.isDirectory(Paths.get(modelName));
    System.out.println("seqgrad " + Model.version() + ", " + (fromDir ? "model " : "preset ") + modelName
        + ", strategy " + strategy);
    final String dtype = flags.getOrDefault("dtype", "f32");
    try (Model model = fromDir ? Model.load(modelName, dtype)
             : Model.fromPreset(modelName, dtype, Long.parseLong(flags.getOrDefault("seed", "0")))) {
      if (loraRank > 0) {
        LoraOptions lo = new LoraOptions().rank(loraRank)
            .alpha(Double.parseDouble(flags.getOrDefault("lora-alpha", "0")))
            .dropout(Double.parseDouble(flags.getOrDefault("lora-dropout", "0")))
            .targets(flags.get("lora-targets"));
        model.enableLora(lo);
        System.out.println(model.lora() + " (" + model.numParams() + " parameters, the base frozen)");
      }
      Trainer.Options options = new Trainer.Options().strategy(strategy).chunk(chunk).pageSize(chunk)
          .lr(Double.parseDouble(flags.getOrDefault("lr", "3e-3")))
          .lrSchedule(flags.getOrDefault("lr-schedule", "constant"))
          .warmupSteps(Long.parseLong(flags.getOrDefault("warmup-steps", "0")))
          .minLr(Double.parseDouble(flags.getOrDefault("min-lr", "0")))
          .totalSteps(totalSteps)
          .gradAccum(gradAccum)
          .numThreads(Integer.parseInt(flags.getOrDefault("threads", "0")));
      try (Trainer trainer = Trainer.create(model, options)) {
        long position = 0;  // records consumed over all epochs
        if (resume) {
          CheckpointState s = trainer.resume(outDir, true);
          if (s != null) {
            position = s.dataPosition;
            System.out.println("resumed from step " + s.step + " (record " + position + ")");
          }
        }
        final long skip = position;
        long seen = 0;  // records read so far, skipped ones included
        for (int epoch = 1; epoch <= epochs && trainer.stepCount() < lastStep; ++epoch) {
          // The file is read lazily, line by line; only one micro-batch is held at a time.
          try (BufferedReader r = Files.newBufferedReader(Paths.get(file), StandardCharsets.UTF_8);
               Stream<Record> lines = records(r, file)) {
            Iterator<Record> seqs = lines.iterator();
            List<int[]> batch = new ArrayList<>(), labels = new ArrayList<>();
            long accumulated = 0;
            while (seqs.hasNext() && trainer.stepCount() < lastStep) {
              Record record = cut(seqs.next(), maxTokens);
              if (seen++ < skip) continue;  // consumed before the checkpoint
              batch.add(record.ids());
              labels.add(record.labels());  // null: next-token labels for this record
              if (batch.size() < batchSize && seqs.hasNext()) continue;
              trainer.accumulateGradients(batch, labels);
              position += batch.size();
              batch.clear();
              labels.clear();
              if (++accumulated < gradAccum && seqs.hasNext()) continue;
              accumulated = 0;
              Metrics m = trainer.optimizerStep();
              System.out.printf("epoch %d step %d loss %.6f lr %.3e tokens %d peak %d bytes%n", epoch, m.step, m.loss,
                  m.lr, m.tokens, m.peakBytes);
              if (outDir != null && ((saveEvery > 0 && m.step % saveEvery == 0) || m.step == lastStep)) {
                System.out.println("saved " + trainer.saveCheckpoint(outDir, position, keep));
              }
            }
          }
        }
        if (outDir != null && trainer.stepCount() == totalSteps) {  // finished: the final adapter or model
          String dir = Paths.get(outDir, loraRank > 0 ? "adapter" : "model").toString();
          if (loraRank > 0) model.saveLoraAdapter(dir, modelName);
          else model.save(dir);
          System.out.println("wrote " + dir);
        }
      }
    }
  }
}
