package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.DoubleBuffer;
import org.junit.jupiter.api.Test;

/**
 * The Java binding's device paths against libseqgrad with the CPU emulation of the CUDA backend (loaded through
 * -Dseqgrad.library.path, see BUILD): a model on "cuda" gives copies, not views of device memory, whose emulation
 * faults on any host access.
 */
class CudaEmulatedTest {
  static double[] values(ByteBuffer b) {
    DoubleBuffer d = b.order(ByteOrder.nativeOrder()).asDoubleBuffer();
    double[] out = new double[d.remaining()];
    d.get(out);
    return out;
  }

  @Test
  void modelOnTheDeviceMatchesTheCpu() {
    int[] ids = new int[19];
    for (int i = 0; i < ids.length; ++i) ids[i] = (i * 37 + 5) % 97;
    try (Model gpu = Model.fromPreset("tiny", "f64", 3, "cuda"); Model cpu = Model.fromPreset("tiny", "f64", 3, "cpu")) {
      assertEquals("cuda", gpu.device());
      for (int i = 0; i < cpu.numParams(); ++i) {
        assertTrue(java.util.Arrays.equals(values(gpu.param(i)), values(cpu.param(i))), cpu.paramName(i));
      }
      for (Model m : new Model[] {gpu, cpu}) {
        try (Trainer t = Trainer.create(m, new Trainer.Options().strategy("seco").chunk(5).pageSize(4))) {
          t.computeGradients(ids, null, new long[] {ids.length});
        }
      }
      for (int i = 0; i < cpu.numParams(); ++i) {
        double[] g = values(gpu.grad(i)), c = values(cpu.grad(i));
        for (int k = 0; k < c.length; ++k) assertEquals(c[k], g[k], 1e-10 * (1 + Math.abs(c[k])), cpu.paramName(i));
      }
      // The copy's writes stay in the copy; setParam reaches the device.
      ByteBuffer copy = gpu.param(1);
      copy.putDouble(0, 42.0);
      assertTrue(values(gpu.param(1))[0] != 42.0);
      gpu.setParam(1, copy);
      assertEquals(42.0, values(gpu.param(1))[0]);
    }
  }
}
