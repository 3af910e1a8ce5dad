package org.seqgrad;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.jar.JarFile;

/**
 * Run by jar_without_system_libs_test.sh: trains a step from the jar alone, checks the version everywhere (argument 0
 * is the expected one) and that every library the engine needs beyond glibc was mapped from the jar's extraction
 * directory (/proc/self/maps).
 */
public final class JarSmoke {
  private static final List<String> BUNDLED = List.of("libseqgrad.so", "libseqgrad_jni.so", "libabsl_", "libopenblas",
      "libgomp", "libgfortran", "libquadmath");

  public static void main(String[] args) throws Exception {
    String version = args[0];
    check(Version.STRING.equals(version), "Version.STRING " + Version.STRING + " != " + version);
    check(version.equals(Model.version()), "native library version " + Model.version() + " != " + version);
    String manifest;  // read from the jar itself: this class shares the package, and defined it first
    try (JarFile jar = new JarFile(Path.of(Model.class.getProtectionDomain().getCodeSource().getLocation().toURI())
        .toFile())) {
      manifest = jar.getManifest().getMainAttributes().getValue("Implementation-Version");
    }
    check(version.equals(manifest), "manifest Implementation-Version " + manifest + " != " + version);

    try (Model m = Model.fromPreset("tiny"); Trainer t = Trainer.create(m, new Trainer.Options())) {
      double loss = t.step(List.of(new int[] {1, 2, 3, 4, 5, 6, 7, 8})).loss;
      check(Double.isFinite(loss) && loss > 0, "loss " + loss);
      System.out.println("step loss " + loss);
    }

    Path dir = NativeApi.DIR.toRealPath();
    Map<String, String> mapped = new TreeMap<>();  // library name -> directory
    for (String line : Files.readAllLines(Path.of("/proc/self/maps"))) {
      int slash = line.indexOf('/');
      if (slash < 0) continue;
      Path p = Path.of(line.substring(slash));
      String name = p.getFileName().toString();
      for (String b : BUNDLED) {
        if (name.startsWith(b)) mapped.put(name, p.getParent().toString());
      }
    }
    Set<String> missing = new TreeSet<>(BUNDLED);
    mapped.forEach((name, from) -> {
      System.out.println("mapped " + name + " from " + from);
      check(from.equals(dir.toString()), name + " was mapped from " + from + ", not from the jar's " + dir);
      missing.removeIf(name::startsWith);
    });
    check(missing.isEmpty(), "not mapped: " + missing);
    System.out.println("OK: " + mapped.size() + " libraries mapped from " + dir);
  }

  private static void check(boolean ok, String what) {
    if (!ok) throw new AssertionError(what);
  }
}
