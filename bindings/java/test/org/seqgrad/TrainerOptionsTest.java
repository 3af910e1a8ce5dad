package org.seqgrad;

import static org.junit.jupiter.api.Assertions.assertEquals;

import java.lang.reflect.Field;
import java.lang.reflect.Modifier;
import org.junit.jupiter.api.Test;

/** Trainer.Options, which the native layer reads field by field: its defaults are the C API's. */
class TrainerOptionsTest {
  @Test
  void defaultsAreTheCDefaults() throws IllegalAccessException {
    Trainer.Options c = NativeApi.trainerDefaultOptions();
    assertEquals(0, c.tp);  // Java's default 1 and C's 0 both mean no tensor parallelism
    c.tp = 1;
    Trainer.Options java = new Trainer.Options();
    for (Field f : Trainer.Options.class.getFields()) {
      if (!Modifier.isStatic(f.getModifiers())) assertEquals(f.get(java), f.get(c), f.getName());
    }
  }
}
