package org.seqgrad;

import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.List;

/**
 * JNI entry points (bindings/java/jni/seqgrad_jni.cc) and the native library loader.
 *
 * <p>Loading: if the system property {@code seqgrad.library.path} names a directory, libseqgrad.so and
 * libseqgrad_jni.so are loaded from it (their dependencies from the system). Otherwise the jar's
 * /org/seqgrad/native/&lt;os&gt;-&lt;arch&gt;/ holds libseqgrad_jni.so, libseqgrad.so and every library they need
 * beyond glibc, libstdc++ and libgcc_s (Abseil, OpenBLAS, libgomp, libgfortran, ...; listed in libs.txt, each with
 * RUNPATH $ORIGIN): all are extracted into one temporary directory and the JNI library is loaded from there, so the
 * loader finds its dependencies beside it and never on the system. /org/seqgrad/native/mpi/&lt;os&gt;-&lt;arch&gt;/ holds
 * libseqgrad_mpi.so, extracted beside them: libseqgrad.so loads it only for tensor parallelism
 * ({@link Trainer.Options#tp}), and it links the system's OpenMPI (the one mpirun belongs to).
 */
final class NativeApi {
  private NativeApi() {}

  static final String[] LIBS = {"libseqgrad.so", "libseqgrad_jni.so"};

  /** The directory the libraries were loaded from. */
  static final Path DIR = load();

  static String platform() {
    String os = System.getProperty("os.name").toLowerCase().startsWith("linux") ? "linux"
        : System.getProperty("os.name").toLowerCase().replace(' ', '_');
    String arch = System.getProperty("os.arch");
    if (arch.equals("amd64") || arch.equals("x86_64")) arch = "x86_64";
    else if (arch.equals("aarch64") || arch.equals("arm64")) arch = "aarch64";
    return os + "-" + arch;
  }

  private static Path load() {
    String dir = System.getProperty("seqgrad.library.path");
    try {
      if (dir != null && !dir.isEmpty()) {
        for (String lib : LIBS) System.load(new File(dir, lib).getAbsolutePath());
        return Path.of(dir).toAbsolutePath();
      }
      String base = "/org/seqgrad/native/" + platform() + "/";
      Path tmp = Files.createTempDirectory("seqgrad-native");
      tmp.toFile().deleteOnExit();
      for (String lib : resourceLines(base + "libs.txt")) {
        try (InputStream in = resource(base + lib)) {
          Path out = tmp.resolve(lib);
          Files.copy(in, out, StandardCopyOption.REPLACE_EXISTING);
          out.toFile().deleteOnExit();
        }
      }
      try (InputStream in = NativeApi.class.getResourceAsStream("/org/seqgrad/native/mpi/" + platform()
          + "/libseqgrad_mpi.so")) {
        if (in != null) {
          Path out = tmp.resolve("libseqgrad_mpi.so");
          Files.copy(in, out, StandardCopyOption.REPLACE_EXISTING);
          out.toFile().deleteOnExit();
        }
      }
      System.load(tmp.resolve("libseqgrad_jni.so").toString());
      return tmp;
    } catch (IOException e) {
      throw new UnsatisfiedLinkError("seqgrad: cannot extract native libraries: " + e);
    }
  }

  private static InputStream resource(String path) {
    InputStream in = NativeApi.class.getResourceAsStream(path);
    if (in == null) {
      throw new UnsatisfiedLinkError("seqgrad: no " + path + " in the jar for platform " + platform()
          + "; set -Dseqgrad.library.path=<dir with " + String.join(", ", LIBS) + ">");
    }
    return in;
  }

  private static List<String> resourceLines(String path) throws IOException {
    try (InputStream in = resource(path)) {
      List<String> lines = new ArrayList<>();
      for (String line : new String(in.readAllBytes(), StandardCharsets.UTF_8).split("\n")) {
        if (!line.isBlank()) lines.add(line.strip());
      }
      return lines;
    }
  }

  static native String version();
  /** The C API's sg_code_name ("UNKNOWN_CODE" for codes it does not define). */
  static native String codeName(int code);
  static native String memoryCategoryName(int c);

  static native long modelCreatePreset(String name, String dtype, long seed, String device, boolean frozenBase);
  static native long modelLoad(String dir, String dtype, String device, boolean frozenBase);
  static native String modelDevice(long h);
  static native void modelSave(long h, String dir, String dtype);
  /** Drops the Model object's reference to the native model. */
  static native void modelFree(long h);
  /** Drops the reference of a view buffer from paramBuffer (its Cleaner). */
  static native void viewRelease(long h, boolean grad);
  /** Gradient view buffers of the model not yet released. */
  static native long gradViews(long h);
  /** Native models and trainers alive in this process (JNI objects). */
  static native long liveHandles();
  /** Bytes of the model's parameter values. */
  static native long modelParamBytes(long h);
  static native long modelVocabSize(long h);
  static native long modelNumParams(long h);
  static native long modelHiddenSize(long h);
  static native long modelNumLayers(long h);
  static native String modelFamily(long h);
  static native String presetName(int i);
  static native String paramName(long h, long i);
  static native long[] paramShape(long h, long i);
  static native String paramDType(long h, long i);
  /** A view holding a reference to the model: register viewRelease(h, grad) as its Cleaner action. */
  static native ByteBuffer paramBuffer(long h, long i, boolean grad);
  /** Whether parameter i lives in device memory (then paramBuffer must not be used: copies instead). */
  static native boolean paramOnDevice(long h, long i);
  /** The bytes of parameter i, or of its gradient (f32 for a bf16 parameter). */
  static native long paramBytes(long h, long i, boolean grad);
  /** Copies parameter i (or its gradient) into dst, a direct buffer of paramBytes; false: a frozen parameter. */
  static native boolean paramRead(long h, long i, boolean grad, ByteBuffer dst);
  /** Copies src, a direct buffer of paramBytes, into parameter i. */
  static native void paramWrite(long h, long i, ByteBuffer src);
  static native void modelSetMemoryLimit(long h, long bytes);
  static native long modelMemoryLimit(long h);
  static native void modelEnableLora(long h, long rank, double alpha, double dropout, String targets, long seed);
  /** null without LoRA. */
  static native LoraOptions modelLora(long h);
  static native void modelSaveLoraAdapter(long h, String dir, String base);
  static native void modelLoadLoraAdapter(long h, String dir);

  /** Reads options field by field: each sg_trainer_options field (cabi/trainer_options.inc) in camelCase. */
  static native long trainerCreate(Trainer.Holder owner, long model, Trainer.Options options);
  /** Options holding the C API's defaults (sg_trainer_default_options), written field by field. */
  static native Trainer.Options trainerDefaultOptions();
  static native void trainerFree(long h);
  static native void trainerCancel(long h);
  static native long trainerStepCount(long h);
  static native void trainerSetReference(long h, long model);
  /** mode 0 = compute_gradients, 1 = step, 2 = optimizer_step, 3 = evaluate, 4 = accumulate_gradients. */
  /** docLengths: null, or per sequence null (one document) or its documents' lengths (sg_batch). */
  static native double[] trainerRun(long h, int mode, int[] ids, int[] labels, long[] lengths, long[][] docLengths);
  /** One log-prob per id (sg_trainer_score), NaN where there is no label. */
  static native double[] trainerScore(long h, int[] ids, int[] labels, long[] lengths, long[][] docLengths);
  /**
   * mode 0 = compute gradients, 1 = step, 4 = accumulate. Label arrays may hold nulls (next-token labels); ref arrays
   * hold NaN for the reference model's values.
   */
  static native double[] trainerDpo(long h, int mode, int[][] chosenIds, int[][] chosenLabels,
      int[][] rejectedIds, int[][] rejectedLabels, double[] refChosenLogp, double[] refRejectedLogp);
  /** One entry per completion (labels and log-prob arrays may hold nulls); groupOffsets: groups + 1 offsets. */
  static native double[] trainerGrpo(long h, int mode, int[][] ids, int[][] labels, double[] advantages,
      double[][] oldLogprobs, double[][] refLogprobs, long[] groupOffsets);
  /** distances may be null; see EvalResult for the layout. */
  static native double[] trainerEvaluateDetailed(long h, int[] ids, int[] labels, long[] lengths, long[] distances,
      long[][] docLengths);
  static native void trainerSaveCheckpoint(long h, String outDir, long dataPosition, long keep);
  /** {step, dataPosition}. */
  static native long[] trainerLoadCheckpoint(long h, String dir);
  static native long[] trainerResume(long h, String outDir);
}
