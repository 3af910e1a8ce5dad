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
 * directory, and nothing of the same name from elsewhere (/proc/self/maps).
 */
public final class JarSmoke {
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
    Set<String> bundled;
    try (InputStream in = NativeApi.class.getResourceAsStream("/org/seqgrad/native/linux-x86_64/libs.txt")) {
      bundled = new TreeSet<>(List.of(new String(in.readAllBytes(), StandardCharsets.UTF_8).split("\n")));
    }
    bundled.remove("libs.txt");
    check(bundled.contains("libseqgrad_jni.so") && bundled.size() > 2, "bundled: " + bundled);
    Map<String, String> mapped = new TreeMap<>();  // bundled library name -> directory it was mapped from
    for (String line : Files.readAllLines(Path.of("/proc/self/maps"))) {
      int slash = line.indexOf('/');
      if (slash < 0) continue;
      Path p = Path.of(line.substring(slash));
      String name = p.getFileName().toString();
      if (bundled.contains(name)) {
        String from = p.getParent().toString();
        check(from.equals(dir.toString()), name + " was mapped from " + from + ", not from the jar's " + dir);
        if (mapped.put(name, from) == null) System.out.println("mapped " + name + " from " + from);
      }
    }
    Set<String> missing = new TreeSet<>(bundled);
    missing.removeAll(mapped.keySet());
    check(missing.isEmpty(), "bundled but not mapped: " + missing);
    System.out.println("OK: all " + mapped.size() + " bundled libraries mapped from " + dir);
  }

  private static void check(boolean ok, String what) {
    if (!ok) throw new AssertionError(what);
  }
}
