package org.seqgrad.toolchain;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;

import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.CsvSource;

class ToolchainTest {
  @Test
  void pureJava() {
    assertEquals("hello seqgrad", NativeAdder.greet("seqgrad"));
  }

  @Test
  void resourceInJar() throws Exception {
    assertEquals("seqgrad-toolchain", NativeAdder.resourceName());
  }

  @ParameterizedTest
  @CsvSource({"1,2,3", "-5,5,0"})
  void jniAdd(int a, int b, int sum) {
    String lib = System.getProperty("seqgrad.toolchain.jni");
    assertNotNull(lib, "-Dseqgrad.toolchain.jni not set");
    NativeAdder.load(lib);
    assertEquals(sum, NativeAdder.add(a, b));
  }
}
