/**
 * seqgrad for Java: {@link org.seqgrad.Model} and {@link org.seqgrad.Trainer} over the engine's C ABI.
 *
 * <p>The jar carries the native libraries for linux-x86_64 with every dependency beyond glibc and the C++ runtime; it
 * extracts them into one temporary directory when the first class is used ({@code -Dseqgrad.library.path=<dir>}
 * loads libseqgrad.so and libseqgrad_jni.so from a directory instead). {@link org.seqgrad.Version#STRING} is the
 * jar's version, {@link org.seqgrad.Model#version()} the loaded library's.
 *
 * <p>Models and trainers are {@link java.lang.AutoCloseable}; forgotten ones are freed after garbage collection.
 * Parameter and gradient views keep their model's memory alive (see {@link org.seqgrad.Model}). Failures throw a
 * subclass of {@link org.seqgrad.SeqgradException} for each status code of the C ABI; null arguments throw {@link
 * org.seqgrad.InvalidArgumentException} naming them; use of a closed handle throws {@link
 * java.lang.IllegalStateException}. A progress listener's exception in a call that completed comes as {@link
 * org.seqgrad.StepAppliedException}: the call's update is in place, so do not retry it.
 */
package org.seqgrad;
