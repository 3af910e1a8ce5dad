// JNI side of org.seqgrad.toolchain.NativeAdder.
#include <jni.h>

extern "C" JNIEXPORT jint JNICALL Java_org_seqgrad_toolchain_NativeAdder_add(JNIEnv*, jclass, jint a, jint b) {
  return a + b;
}
