package org.seqgrad;

import java.io.InputStream;
import java.nio.charset.StandardCharsets;
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
 * is the expected one) and that every library the jar bundles (its libs.txt) was mapped from the jar's extraction
 * directory (/proc/self/maps), except those the JVM had loaded before (the C++ runtime of a JVM linked with it).
 */
public final class JarSmoke {
  public static void main(String[] args) throws Exception {
    Map<String, String> before = mappedLibraries();  // Version.STRING is a constant: nothing is loaded yet
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
    Set<String> bundled;
    try (InputStream in = NativeApi.class.getResourceAsStream("/org/seqgrad/native/linux-x86_64/libs.txt")) {
      bundled = new TreeSet<>(List.of(new String(in.readAllBytes(), StandardCharsets.UTF_8).split("\n")));
    }
    bundled.remove("libs.txt");
    check(bundled.contains("libseqgrad_jni.so") && bundled.size() > 2, "bundled: " + bundled);
    Map<String, String> mapped = mappedLibraries();
    for (String name : bundled) {
      String from = mapped.get(name);
      // Already in the process (its file is named by the SONAME or a longer version of it): the loader uses that one.
      String preloaded = before.keySet().stream().filter(f -> f.startsWith(name)).findFirst().orElse(null);
      if (preloaded != null) {
        System.out.println(name + ": the JVM's own, loaded before from " + before.get(preloaded) + "/" + preloaded);
        continue;
      }
      check(from != null, name + " is bundled but not mapped");
      check(from.equals(dir.toString()), name + " was mapped from " + from + ", not from the jar's " + dir);
      System.out.println("mapped " + name + " from " + from);
    }
    System.out.println("OK: the bundled libraries were mapped from " + dir);
  }

  /** File name -> directory of every file mapped into this process. */
  private static Map<String, String> mappedLibraries() throws Exception {
    Map<String, String> mapped = new TreeMap<>();
    for (String line : Files.readAllLines(Path.of("/proc/self/maps"))) {
      int slash = line.indexOf('/');
      if (slash < 0) continue;
      Path p = Path.of(line.substring(slash));
      mapped.put(p.getFileName().toString(), p.getParent().toString());
    }
    return mapped;
  }

  private static void check(boolean ok, String what) {
    if (!ok) throw new AssertionError(what);
  }
}
