package org.seqgrad.toolchain;

/** Smallest possible JNI binding: proves //third_party:jni and System.load work. */
public final class NativeAdder {
  private NativeAdder() {}

  /** Loads the JNI library from the absolute or working-directory-relative path. */
  public static void load(String path) {
    System.load(new java.io.File(path).getAbsolutePath());
  }

  public static native int add(int a, int b);

  public static String greet(String who) {
    return "hello " + who;
  }

  /** Reads a resource packed by java_jar(resources = ...). */
  public static String resourceName() throws java.io.IOException {
    try (java.io.InputStream in = NativeAdder.class.getResourceAsStream("name.txt")) {
      if (in == null) return null;
      return new String(in.readAllBytes(), java.nio.charset.StandardCharsets.UTF_8).trim();
    }
  }
}
