// JNI glue for org.seqgrad.NativeApi over the seqgrad C ABI (seqgrad/seqgrad.h) only.
// Failed statuses become the exception that org.seqgrad.SeqgradException.of(code, message) picks for the code;
// no C++ exception leaves this file.
#include <jni.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "cabi/grad_views.h"
#include "cabi/trainer_options.h"
#include "seqgrad/seqgrad.h"

namespace {

JavaVM* g_vm = nullptr;

// Throws SeqgradException.of(code, msg): the typed subclass for the code (one place maps codes to classes).
void ThrowCode(JNIEnv* env, int code, const std::string& msg) {
  jclass cls = env->FindClass("org/seqgrad/SeqgradException");
  if (!cls) return;  // NoClassDefFoundError pending
  jmethodID of = env->GetStaticMethodID(cls, "of", "(ILjava/lang/String;)Lorg/seqgrad/SeqgradException;");
  if (!of) return;
  jstring jmsg = env->NewStringUTF(msg.c_str());
  if (!jmsg) return;  // OutOfMemoryError pending
  jobject exc = env->CallStaticObjectMethod(cls, of, static_cast<jint>(code), jmsg);
  if (exc && !env->ExceptionCheck()) env->Throw(static_cast<jthrowable>(exc));
}

// Native objects alive (JModel + JTrainer): tests check that Cleaners free forgotten handles.
std::atomic<int64_t> g_live_handles{0};

// The native side of an org.seqgrad.Model: one sg_model reference shared by the Model object and by every view
// buffer it handed out (Model.param/grad), each holding a count until its Cleaner runs. The model is released with
// the last of them, so a view never outlives the memory it points at.
struct JModel {
  explicit JModel(sg_model* model) : m(model) { ++g_live_handles; }
  sg_model* m;
  std::atomic<int64_t> refs{1};
  sg::cabi::GradViews grad_views;  // live direct buffers of gradients (paramBuffer)
};

void Unref(JModel* jm) {
  if (jm->refs.fetch_sub(1) != 1) return;
  sg_model_free(jm->m);
  delete jm;
  --g_live_handles;
}

// Before a call that enables LoRA (cabi/grad_views.h), with jm->grad_views locked: true (FAILED_PRECONDITION
// thrown) while gradient views of the model live.
bool GradViewsLive(JNIEnv* env, JModel* jm, const char* what, bool enables_only_without_lora) {
  const std::string refusal = jm->grad_views.LoraRefusal(jm->m, what, enables_only_without_lora,
                                                         "gradient view(s) of the model (Model.grad)");
  if (refusal.empty()) return false;
  ThrowCode(env, SG_ERR_FAILED_PRECONDITION, refusal);
  return true;
}

// Throws for a failed status (frees it); returns true when it threw.
bool Failed(JNIEnv* env, sg_status* st) {
  if (!st) return false;
  ThrowCode(env, sg_status_code(st), sg_status_message(st));
  sg_status_free(st);
  return true;
}

std::string Str(JNIEnv* env, jstring s) {
  if (!s) return std::string();
  const char* c = env->GetStringUTFChars(s, nullptr);
  std::string r = c ? c : "";
  if (c) env->ReleaseStringUTFChars(s, c);
  return r;
}

// Per-trainer JNI state: the C trainer plus a global ref to the Java Trainer receiving progress events.
struct JTrainer {
  sg_trainer* t = nullptr;
  jobject owner = nullptr;      // global ref to org.seqgrad.Trainer
  jthrowable pending = nullptr; // global ref to an exception thrown by the listener
};

void OnProgress(void* user, const sg_progress* p) {
  auto* jt = static_cast<JTrainer*>(user);
  JNIEnv* env = nullptr;
  if (!g_vm || g_vm->GetEnv(reinterpret_cast<void**>(&env), JNI_VERSION_1_8) != JNI_OK || !env) return;
  if (jt->pending) return;
  jclass cls = env->GetObjectClass(jt->owner);
  jmethodID m = env->GetMethodID(cls, "onProgress", "(JDJDI)V");
  env->DeleteLocalRef(cls);
  if (!m) {
    env->ExceptionClear();
    return;
  }
  env->CallVoidMethod(jt->owner, m, static_cast<jlong>(p->step), p->loss, static_cast<jlong>(p->tokens),
                      p->grad_norm, static_cast<jint>(p->phase));
  if (jthrowable e = env->ExceptionOccurred()) {
    env->ExceptionClear();
    jt->pending = static_cast<jthrowable>(env->NewGlobalRef(e));
    env->DeleteLocalRef(e);
  }
}

jdoubleArray ToJava(JNIEnv* env, const std::vector<double>& v) {
  jdoubleArray a = env->NewDoubleArray(static_cast<jsize>(v.size()));
  if (a) env->SetDoubleArrayRegion(a, 0, static_cast<jsize>(v.size()), v.data());
  return a;
}

jdoubleArray MetricsArray(JNIEnv* env, const sg_metrics& m) {
  // [loss, tokens, grad_norm, step, peak_bytes, seconds, chunks, chunks_backpropagated, adjoint_pairs, lr,
  //  micro_batches, tp, tp_bytes_reduced, peak_by_category x9, at_peak_by_category x9] (Metrics.java reads this
  //  layout; the 9th category, master_weights, comes from its own sg_metrics fields)
  std::vector<jdouble> v = {m.loss, static_cast<double>(m.tokens), m.grad_norm, static_cast<double>(m.step),
                            static_cast<double>(m.peak_bytes), m.seconds, static_cast<double>(m.chunks),
                            static_cast<double>(m.chunks_backpropagated), static_cast<double>(m.adjoint_pairs),
                            m.lr, static_cast<double>(m.micro_batches), static_cast<double>(m.tp),
                            static_cast<double>(m.tp_bytes_reduced)};
  for (int c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c) v.push_back(static_cast<double>(m.peak_bytes_by_category[c]));
  v.push_back(static_cast<double>(m.peak_bytes_master_weights));
  for (int c = 0; c < SG_NUM_MEMORY_CATEGORIES; ++c) v.push_back(static_cast<double>(m.bytes_at_peak_by_category[c]));
  v.push_back(static_cast<double>(m.bytes_at_peak_master_weights));
  static_assert(SG_NUM_MEMORY_CATEGORIES_ALL == SG_NUM_MEMORY_CATEGORIES + 1, "report the new category here");
  return ToJava(env, v);
}

JModel* JM(jlong h) { return reinterpret_cast<JModel*>(h); }
sg_model* M(jlong h) { return h ? JM(h)->m : nullptr; }
JTrainer* T(jlong h) { return reinterpret_cast<JTrainer*>(h); }

// Throws what the progress listener threw during a call, wrapped in StepAppliedException when the call completed
// (its update is in place: a caller must not retry it).
void ThrowListenerException(JNIEnv* env, JTrainer* jt, bool completed) {
  jthrowable e = jt->pending;
  jt->pending = nullptr;
  jthrowable thrown = e;
  if (completed) {
    jclass cls = env->FindClass("org/seqgrad/StepAppliedException");
    jmethodID ctor = cls ? env->GetMethodID(cls, "<init>", "(JLjava/lang/Throwable;)V") : nullptr;
    const jlong step = sg_trainer_step_count(jt->t);
    thrown = ctor ? static_cast<jthrowable>(env->NewObject(cls, ctor, step, e)) : nullptr;
  }
  if (thrown) env->Throw(thrown);  // else an error (no class, out of memory) is pending
  env->DeleteGlobalRef(e);
}

// The metrics of a trainer call, or null with an exception pending: the progress listener's (thrown on this thread)
// first, else the failed status's. Frees st.
jdoubleArray Finish(JNIEnv* env, JTrainer* jt, sg_status* st, const sg_metrics& m) {
  if (jt && jt->pending && (st == nullptr || sg_status_code(st) != SG_ERR_BUSY)) {
    ThrowListenerException(env, jt, st == nullptr);
    sg_status_free(st);
    return nullptr;
  }
  if (Failed(env, st)) return nullptr;
  return MetricsArray(env, m);
}

// Copies the entries of an int[][] / double[][] (entries may be null: NULL pointers) for the C API; the pointer of an
// empty entry is non-NULL so that the C API reports its length, not a NULL.
template <typename T>
struct Arrays {
  std::vector<std::vector<T>> data;
  std::vector<const T*> ptrs;
  std::vector<int64_t> lengths;
};

template <typename T, typename JArray, typename Get>
Arrays<T> ReadArrays(JNIEnv* env, jobjectArray a, Get get) {
  static T empty[1];
  Arrays<T> out;
  const jsize n = a ? env->GetArrayLength(a) : 0;
  out.data.resize(n);
  for (jsize i = 0; i < n; ++i) {
    auto e = static_cast<JArray>(env->GetObjectArrayElement(a, i));
    if (!e) {
      out.ptrs.push_back(nullptr);
      out.lengths.push_back(0);
      continue;
    }
    out.data[i].resize(env->GetArrayLength(e));
    (env->*get)(e, 0, static_cast<jsize>(out.data[i].size()), out.data[i].data());
    env->DeleteLocalRef(e);
    out.ptrs.push_back(out.data[i].empty() ? empty : out.data[i].data());
    out.lengths.push_back(static_cast<int64_t>(out.data[i].size()));
  }
  return out;
}

using IntArrays = Arrays<jint>;
using DoubleArrays = Arrays<jdouble>;
IntArrays ReadInts(JNIEnv* env, jobjectArray a) {
  return ReadArrays<jint, jintArray>(env, a, &JNIEnv::GetIntArrayRegion);
}
DoubleArrays ReadDoubles(JNIEnv* env, jobjectArray a) {
  return ReadArrays<jdouble, jdoubleArray>(env, a, &JNIEnv::GetDoubleArrayRegion);
}

// A Java array copied for the C API. data() is NULL for a null array and non-NULL for an empty one, so that the C
// API's count checks (not its NULL checks) report empty arrays.
template <typename T>
struct Copied {
  bool present = false;
  std::vector<T> v;
  const T* data() const {
    static T empty[1];
    return !present ? nullptr : v.empty() ? empty : v.data();
  }
  int64_t size() const { return static_cast<int64_t>(v.size()); }
};

template <typename T, typename JArray, typename JElem>
Copied<T> Copy(JNIEnv* env, JArray a, void (JNIEnv::*get)(JArray, jsize, jsize, JElem*)) {
  static_assert(sizeof(T) == sizeof(JElem), "Java and C element types differ in size");
  Copied<T> c;
  c.present = a != nullptr;
  if (a) {
    c.v.resize(env->GetArrayLength(a));
    (env->*get)(a, 0, static_cast<jsize>(c.v.size()), reinterpret_cast<JElem*>(c.v.data()));
  }
  return c;
}

// A flat batch (ids, labels, lengths as sg_trainer_compute_gradients takes them, and the documents of each
// sequence) copied before the call.
struct FlatBatch {
  Copied<int32_t> ids, labels;
  Copied<int64_t> lengths;
  std::vector<int64_t> num_documents, doc_lengths;  // num_documents empty: no documents
  sg_batch C() const {
    sg_batch b = sg_batch_init();
    b.ids = ids.data();
    b.labels = labels.data();
    b.num_tokens = ids.size();
    b.lengths = lengths.data();
    b.num_sequences = lengths.size();
    b.num_documents = num_documents.empty() ? nullptr : num_documents.data();
    b.doc_lengths = doc_lengths.empty() ? nullptr : doc_lengths.data();
    return b;
  }
};

// False with an exception pending when a per-token array (present) does not have the ids' length.
bool AlignedWithIds(JNIEnv* env, const FlatBatch& b, bool present, int64_t size, const char* name) {
  if (!present || size == b.ids.size()) return true;
  ThrowCode(env, SG_ERR_INVALID_ARGUMENT,
            std::string(name) + " has " + std::to_string(size) + " entries but ids has " +
                std::to_string(b.ids.size()) + " (one per token, aligned with ids)");
  return false;
}

// False with an exception pending when labels do not align with ids, or docLengths (null, or one entry per
// sequence: null or its documents' lengths) has another number of sequences.
bool ReadFlatBatch(JNIEnv* env, jintArray ids, jintArray labels, jlongArray lengths, jobjectArray doc_lengths,
                   FlatBatch* b) {
  b->ids = Copy<int32_t>(env, ids, &JNIEnv::GetIntArrayRegion);
  b->labels = Copy<int32_t>(env, labels, &JNIEnv::GetIntArrayRegion);
  b->lengths = Copy<int64_t>(env, lengths, &JNIEnv::GetLongArrayRegion);
  if (!AlignedWithIds(env, *b, b->labels.present, b->labels.size(), "labels")) return false;
  if (!doc_lengths) return true;
  const Arrays<jlong> docs = ReadArrays<jlong, jlongArray>(env, doc_lengths, &JNIEnv::GetLongArrayRegion);
  if (static_cast<int64_t>(docs.ptrs.size()) != b->lengths.size()) {
    ThrowCode(env, SG_ERR_INVALID_ARGUMENT,
              "docLengths has " + std::to_string(docs.ptrs.size()) + " entries but lengths has " +
                  std::to_string(b->lengths.size()) + " (one per sequence)");
    return false;
  }
  b->num_documents = docs.lengths;
  for (const std::vector<jlong>& d : docs.data) b->doc_lengths.insert(b->doc_lengths.end(), d.begin(), d.end());
  return true;
}

// Per-sequence arrays that the C API reads by the ids' lengths (Trainer.java checks them first): false with an
// exception pending when an entry (not null) has another length.
template <typename T>
bool SameLengths(JNIEnv* env, const IntArrays& ids, const Arrays<T>& other, const char* what) {
  for (size_t i = 0; i < ids.ptrs.size(); ++i) {
    if (i >= other.ptrs.size() || (other.ptrs[i] && other.lengths[i] != ids.lengths[i])) {
      ThrowCode(env, SG_ERR_INVALID_ARGUMENT,
                std::string(what) + "[" + std::to_string(i) + "] does not have the length of ids[" +
                    std::to_string(i) + "] (" + std::to_string(ids.lengths[i]) + ")");
      return false;
    }
  }
  return true;
}

}  // namespace

#define JNI_FN(ret, name) extern "C" JNIEXPORT ret JNICALL Java_org_seqgrad_NativeApi_##name
#define GUARD_BEGIN try {
#define GUARD_END(ret)                                          \
  }                                                             \
  catch (const std::exception& e) {                             \
    ThrowCode(env, SG_ERR_INTERNAL, e.what());                  \
  }                                                             \
  catch (...) {                                                 \
    ThrowCode(env, SG_ERR_UNKNOWN, "unknown C++ exception");    \
  }                                                             \
  return ret;

extern "C" JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM* vm, void*) {
  g_vm = vm;
  return JNI_VERSION_1_8;
}

JNI_FN(jstring, version)(JNIEnv* env, jclass) { return env->NewStringUTF(sg_version()); }
JNI_FN(jstring, codeName)(JNIEnv* env, jclass, jint code) { return env->NewStringUTF(sg_code_name(code)); }

JNI_FN(jstring, memoryCategoryName)(JNIEnv* env, jclass, jint c) {
  const char* n = sg_memory_category_name(c);
  return n ? env->NewStringUTF(n) : nullptr;
}

JNI_FN(jlong, modelCreatePreset)
(JNIEnv* env, jclass, jstring name, jstring dtype, jlong seed, jstring device, jboolean frozen_base) {
  GUARD_BEGIN
  sg_model* m = nullptr;
  const std::string n = Str(env, name), d = Str(env, dtype), dev = Str(env, device);
  sg_model_options o = sg_model_default_options();
  o.dtype = dtype ? d.c_str() : nullptr;
  o.device = device ? dev.c_str() : nullptr;
  o.seed = static_cast<uint64_t>(seed);
  o.frozen_base = frozen_base == JNI_TRUE;
  if (Failed(env, sg_model_create_preset_with(name ? n.c_str() : nullptr, &o, &m))) return 0;
  return reinterpret_cast<jlong>(new JModel(m));
  GUARD_END(0)
}

JNI_FN(jlong, modelLoad)(JNIEnv* env, jclass, jstring dir, jstring dtype, jstring device, jboolean frozen_base) {
  GUARD_BEGIN
  sg_model* m = nullptr;
  const std::string p = Str(env, dir), d = Str(env, dtype), dev = Str(env, device);
  sg_model_options o = sg_model_default_options();
  o.dtype = dtype ? d.c_str() : nullptr;
  o.device = device ? dev.c_str() : nullptr;
  o.frozen_base = frozen_base == JNI_TRUE;
  if (Failed(env, sg_model_load_with(dir ? p.c_str() : nullptr, &o, &m))) return 0;
  return reinterpret_cast<jlong>(new JModel(m));
  GUARD_END(0)
}

JNI_FN(jstring, modelDevice)(JNIEnv* env, jclass, jlong h) { return env->NewStringUTF(sg_model_device(M(h))); }

JNI_FN(void, modelSave)(JNIEnv* env, jclass, jlong h, jstring dir, jstring dtype) {
  GUARD_BEGIN
  const std::string p = Str(env, dir), d = Str(env, dtype);
  Failed(env, sg_model_save_as(M(h), dir ? p.c_str() : nullptr, dtype ? d.c_str() : nullptr));
  GUARD_END()
}

// Drops the Model object's reference (close() or its Cleaner).
JNI_FN(void, modelFree)(JNIEnv*, jclass, jlong h) { Unref(JM(h)); }

// Drops a view buffer's reference (its Cleaner).
JNI_FN(void, viewRelease)(JNIEnv*, jclass, jlong h, jboolean grad) {
  if (grad) JM(h)->grad_views.Release();
  Unref(JM(h));
}

JNI_FN(jlong, gradViews)(JNIEnv*, jclass, jlong h) {
  return JM(h)->grad_views.Live();
}

JNI_FN(jlong, liveHandles)(JNIEnv*, jclass) { return g_live_handles.load(); }
JNI_FN(jlong, modelVocabSize)(JNIEnv*, jclass, jlong h) { return sg_model_vocab_size(M(h)); }
JNI_FN(jlong, modelNumParams)(JNIEnv*, jclass, jlong h) { return sg_model_num_params(M(h)); }
JNI_FN(jlong, modelHiddenSize)(JNIEnv*, jclass, jlong h) { return sg_model_hidden_size(M(h)); }
JNI_FN(jlong, modelNumLayers)(JNIEnv*, jclass, jlong h) { return sg_model_num_layers(M(h)); }
JNI_FN(jstring, modelFamily)(JNIEnv* env, jclass, jlong h) { return env->NewStringUTF(sg_model_family(M(h))); }

// The i-th built-in preset name; null past the end.
JNI_FN(jstring, presetName)(JNIEnv* env, jclass, jint i) {
  const char* const* names = sg_model_preset_names();
  for (jint k = 0; k < i; ++k)
    if (!names[k]) return nullptr;
  return names[i] ? env->NewStringUTF(names[i]) : nullptr;
}

JNI_FN(jstring, paramName)(JNIEnv* env, jclass, jlong h, jlong i) {
  GUARD_BEGIN
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return nullptr;
  return env->NewStringUTF(p.name);
  GUARD_END(nullptr)
}

JNI_FN(jlongArray, paramShape)(JNIEnv* env, jclass, jlong h, jlong i) {
  GUARD_BEGIN
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return nullptr;
  jlongArray a = env->NewLongArray(p.ndim);
  std::vector<jlong> s(p.shape, p.shape + p.ndim);
  if (a) env->SetLongArrayRegion(a, 0, p.ndim, s.data());
  return a;
  GUARD_END(nullptr)
}

JNI_FN(jstring, paramDType)(JNIEnv* env, jclass, jlong h, jlong i) {
  GUARD_BEGIN
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return nullptr;
  return env->NewStringUTF(sg_dtype_name(p.dtype));
  GUARD_END(nullptr)
}

// A direct ByteBuffer over the parameter (or its gradient): zero-copy; null for a missing gradient. The buffer holds
// a reference to the model: the caller registers a Cleaner on it that calls viewRelease(h, grad).
namespace {
// The C ABI's element size of a dtype.
jlong ElementBytes(int dtype) {
  return dtype == SG_DTYPE_F64 || dtype == SG_DTYPE_I64 ? 8 : dtype == SG_DTYPE_F32 || dtype == SG_DTYPE_I32 ? 4 : 2;
}
}  // namespace

JNI_FN(jobject, paramBuffer)(JNIEnv* env, jclass, jlong h, jlong i, jboolean grad) {
  GUARD_BEGIN
  auto lock = JM(h)->grad_views.Lock();  // a LoRA call cannot release the gradient in between
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return nullptr;
  void* ptr = grad ? p.grad : p.data;
  if (!ptr) return nullptr;
  const int dtype = grad ? sg_model_dtype(M(h)) : p.dtype;  // a bf16 parameter's gradient is f32
  jobject buffer = env->NewDirectByteBuffer(ptr, p.numel * ElementBytes(dtype));
  if (!buffer) return nullptr;
  ++JM(h)->refs;
  if (grad) JM(h)->grad_views.Retain();
  return buffer;
  GUARD_END(nullptr)
}

// Bytes of the model's parameter values (the gradients hold as many; the optimizer's moments twice that).
JNI_FN(jlong, modelParamBytes)(JNIEnv*, jclass, jlong h) {
  jlong bytes = 0;
  sg_param_info p = sg_param_info_init();
  for (int64_t i = 0; i < sg_model_num_params(M(h)); ++i) {
    sg_status* st = sg_model_param_info(M(h), i, &p);
    if (!st) bytes += p.numel * ElementBytes(p.dtype);
    sg_status_free(st);
  }
  return bytes;
}

JNI_FN(jboolean, paramOnDevice)(JNIEnv* env, jclass, jlong h, jlong i) {
  GUARD_BEGIN
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return JNI_FALSE;
  return p.on_device ? JNI_TRUE : JNI_FALSE;
  GUARD_END(JNI_FALSE)
}

JNI_FN(jlong, paramBytes)(JNIEnv* env, jclass, jlong h, jlong i, jboolean grad) {
  GUARD_BEGIN
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return 0;
  return p.numel * ElementBytes(grad ? sg_model_dtype(M(h)) : p.dtype);  // a bf16 parameter's gradient is f32
  GUARD_END(0)
}

JNI_FN(jboolean, paramRead)(JNIEnv* env, jclass, jlong h, jlong i, jboolean grad, jobject dst) {
  GUARD_BEGIN
  sg_param_info p = sg_param_info_init();
  if (Failed(env, sg_model_param_info(M(h), i, &p))) return JNI_FALSE;
  if (grad && !p.grad) return JNI_FALSE;
  if (Failed(env, sg_model_read_param(M(h), i, grad ? SG_PARAM_GRAD : SG_PARAM_VALUE, env->GetDirectBufferAddress(dst),
                                      static_cast<size_t>(env->GetDirectBufferCapacity(dst)))))
    return JNI_FALSE;
  return JNI_TRUE;
  GUARD_END(JNI_FALSE)
}

JNI_FN(void, paramWrite)(JNIEnv* env, jclass, jlong h, jlong i, jobject src) {
  GUARD_BEGIN
  Failed(env, sg_model_write_param(M(h), i, SG_PARAM_VALUE, env->GetDirectBufferAddress(src),
                                   static_cast<size_t>(env->GetDirectBufferCapacity(src))));
  GUARD_END()
}

namespace {
using sg::cabi::OptionKind;

// The field of org.seqgrad.Trainer.Options for an sg_trainer_options field: its name in camelCase (page_size:
// pageSize), of the Java type of its kind.
jfieldID OptionsField(JNIEnv* env, jclass cls, const char* c_name, OptionKind kind) {
  std::string name;
  for (const char* c = c_name; *c; ++c) name += *c == '_' && c[1] ? static_cast<char>(std::toupper(*++c)) : *c;
  const char* sig = kind == OptionKind::kString   ? "Ljava/lang/String;"
                    : kind == OptionKind::kDouble ? "D"
                    : kind == OptionKind::kBool   ? "Z"
                    : kind == OptionKind::kInt32  ? "I"
                                                  : "J";
  return env->GetFieldID(cls, name.c_str(), sig);
}

// Reads one option from a Trainer.Options object; false with a Java exception pending. `strings` keeps the string
// options' bytes; a null String is the C default.
template <OptionKind K, typename T>
bool ReadOption(JNIEnv* env, jobject options, jclass cls, const char* c_name, std::deque<std::string>* strings,
                T* field) {
  jfieldID id = OptionsField(env, cls, c_name, K);
  if (!id) return false;
  if constexpr (K == OptionKind::kString) {
    auto s = static_cast<jstring>(env->GetObjectField(options, id));
    *field = s ? strings->emplace_back(Str(env, s)).c_str() : nullptr;
    env->DeleteLocalRef(s);
  } else if constexpr (K == OptionKind::kDouble) {
    *field = env->GetDoubleField(options, id);
  } else if constexpr (K == OptionKind::kBool) {
    *field = env->GetBooleanField(options, id) ? 1 : 0;
  } else if constexpr (K == OptionKind::kInt32) {
    *field = env->GetIntField(options, id);
  } else {
    *field = static_cast<T>(env->GetLongField(options, id));  // Java has no unsigned long: a seed's bits carry over
  }
  return true;
}

// Writes one option into a Trainer.Options object; false with a Java exception pending.
template <OptionKind K, typename T>
bool WriteOption(JNIEnv* env, jobject options, jclass cls, const char* c_name, T value) {
  jfieldID id = OptionsField(env, cls, c_name, K);
  if (!id) return false;
  if constexpr (K == OptionKind::kString) {
    jstring s = env->NewStringUTF(value);
    if (!s) return false;
    env->SetObjectField(options, id, s);
    env->DeleteLocalRef(s);
  } else if constexpr (K == OptionKind::kDouble) {
    env->SetDoubleField(options, id, value);
  } else if constexpr (K == OptionKind::kBool) {
    env->SetBooleanField(options, id, value != 0);
  } else if constexpr (K == OptionKind::kInt32) {
    env->SetIntField(options, id, value);
  } else {
    env->SetLongField(options, id, static_cast<jlong>(value));
  }
  return true;
}
}  // namespace

// A Trainer.Options holding sg_trainer_default_options(), written field by field as trainerCreate reads them.
JNI_FN(jobject, trainerDefaultOptions)(JNIEnv* env, jclass) {
  GUARD_BEGIN
  jclass cls = env->FindClass("org/seqgrad/Trainer$Options");
  jmethodID init = cls ? env->GetMethodID(cls, "<init>", "()V") : nullptr;
  jobject options = init ? env->NewObject(cls, init) : nullptr;
  if (!options) return nullptr;
  const sg_trainer_options o = sg_trainer_default_options();
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) \
  if (!WriteOption<OptionKind::kind>(env, options, cls, #name, o.name)) return nullptr;
#include "cabi/trainer_options.inc"
  return options;
  GUARD_END(nullptr)
}

// options: an org.seqgrad.Trainer.Options, read field by field (cabi/trainer_options.inc).
JNI_FN(jlong, trainerCreate)(JNIEnv* env, jclass, jobject owner, jlong model, jobject options) {
  GUARD_BEGIN
  std::deque<std::string> strings;
  sg_trainer_options o = sg_trainer_default_options();
  jclass cls = env->GetObjectClass(options);
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) \
  if (!ReadOption<OptionKind::kind>(env, options, cls, #name, &strings, &o.name)) return 0;
#include "cabi/trainer_options.inc"
  env->DeleteLocalRef(cls);
  sg_trainer* t = nullptr;
  if (Failed(env, sg_trainer_create(M(model), &o, &t))) return 0;
  auto* jt = new JTrainer;
  ++g_live_handles;
  jt->t = t;
  jt->owner = env->NewGlobalRef(owner);
  if (Failed(env, sg_trainer_set_progress_callback(t, OnProgress, jt))) {
    env->DeleteGlobalRef(jt->owner);
    sg_trainer_free(t);
    delete jt;
    --g_live_handles;
    return 0;
  }
  return reinterpret_cast<jlong>(jt);
  GUARD_END(0)
}

JNI_FN(void, trainerFree)(JNIEnv* env, jclass, jlong h) {
  JTrainer* jt = T(h);
  if (!jt) return;
  sg_trainer_free(jt->t);
  if (jt->owner) env->DeleteGlobalRef(jt->owner);
  if (jt->pending) env->DeleteGlobalRef(jt->pending);
  delete jt;
  --g_live_handles;
}

JNI_FN(void, trainerCancel)(JNIEnv*, jclass, jlong h) {
  if (T(h)) sg_trainer_cancel(T(h)->t);
}

JNI_FN(jlong, trainerStepCount)(JNIEnv*, jclass, jlong h) { return T(h) ? sg_trainer_step_count(T(h)->t) : -1; }

JNI_FN(void, modelSetMemoryLimit)(JNIEnv* env, jclass, jlong h, jlong bytes) {
  GUARD_BEGIN
  Failed(env, sg_model_set_memory_limit(M(h), bytes));
  GUARD_END()
}

JNI_FN(jlong, modelMemoryLimit)(JNIEnv*, jclass, jlong h) { return sg_model_memory_limit(M(h)); }

JNI_FN(void, trainerSetReference)(JNIEnv* env, jclass, jlong h, jlong model) {
  GUARD_BEGIN
  Failed(env, sg_trainer_set_reference(T(h) ? T(h)->t : nullptr, M(model)));
  GUARD_END()
}

// mode 0 = compute gradients, 1 = step, 4 = accumulate (as trainerRun's).
JNI_FN(jdoubleArray, trainerDpo)(JNIEnv* env, jclass, jlong h, jint mode, jobjectArray chosen_ids,
                                 jobjectArray chosen_labels, jobjectArray rejected_ids, jobjectArray rejected_labels,
                                 jdoubleArray ref_chosen, jdoubleArray ref_rejected) {
  GUARD_BEGIN
  JTrainer* jt = T(h);
  const IntArrays ci = ReadInts(env, chosen_ids), cl = ReadInts(env, chosen_labels);
  const IntArrays ri = ReadInts(env, rejected_ids), rl = ReadInts(env, rejected_labels);
  const std::vector<double> rc = Copy<double>(env, ref_chosen, &JNIEnv::GetDoubleArrayRegion).v;
  const std::vector<double> rr = Copy<double>(env, ref_rejected, &JNIEnv::GetDoubleArrayRegion).v;
  const size_t n = ci.ptrs.size();
  if (!SameLengths(env, ci, cl, "chosenLabels") || !SameLengths(env, ri, rl, "rejectedLabels"))
    return nullptr;
  if (ri.ptrs.size() != n || rc.size() != n || rr.size() != n) {
    ThrowCode(env, SG_ERR_INVALID_ARGUMENT, "the pair arrays differ in length");
    return nullptr;
  }
  sg_metrics m = sg_metrics_init();
  auto fn = mode == 1   ? sg_trainer_step_dpo
            : mode == 4 ? sg_trainer_accumulate_gradients_dpo
                        : sg_trainer_compute_gradients_dpo;
  sg_status* st = fn(jt ? jt->t : nullptr, ci.ptrs.data(), cl.ptrs.data(), ci.lengths.data(), ri.ptrs.data(),
                     rl.ptrs.data(), ri.lengths.data(), rc.data(), rr.data(), static_cast<int64_t>(n), &m);
  return Finish(env, jt, st, m);
  GUARD_END(nullptr)
}

JNI_FN(jdoubleArray, trainerGrpo)(JNIEnv* env, jclass, jlong h, jint mode, jobjectArray ids, jobjectArray labels,
                                  jdoubleArray advantages, jobjectArray old_logprobs, jobjectArray ref_logprobs,
                                  jlongArray group_offsets) {
  GUARD_BEGIN
  JTrainer* jt = T(h);
  const IntArrays si = ReadInts(env, ids), sl = ReadInts(env, labels);
  const DoubleArrays old = ReadDoubles(env, old_logprobs), ref = ReadDoubles(env, ref_logprobs);
  const std::vector<double> adv = Copy<double>(env, advantages, &JNIEnv::GetDoubleArrayRegion).v;
  const std::vector<int64_t> offsets = Copy<int64_t>(env, group_offsets, &JNIEnv::GetLongArrayRegion).v;
  if (!SameLengths(env, si, sl, "labels") || !SameLengths(env, si, old, "oldLogprobs") ||
      !SameLengths(env, si, ref, "refLogprobs"))
    return nullptr;
  if (adv.size() != si.ptrs.size() || offsets.empty()) {
    ThrowCode(env, SG_ERR_INVALID_ARGUMENT, "the completion arrays differ in length");
    return nullptr;
  }
  sg_metrics m = sg_metrics_init();
  auto fn = mode == 1   ? sg_trainer_step_grpo
            : mode == 4 ? sg_trainer_accumulate_gradients_grpo
                        : sg_trainer_compute_gradients_grpo;
  sg_status* st = fn(jt ? jt->t : nullptr, si.ptrs.data(), sl.ptrs.data(), si.lengths.data(), adv.data(),
                     old.ptrs.data(), ref.ptrs.data(), static_cast<int64_t>(si.ptrs.size()), offsets.data(),
                     static_cast<int64_t>(offsets.size()) - 1, &m);
  return Finish(env, jt, st, m);
  GUARD_END(nullptr)
}

// mode 0 = compute_gradients, 1 = step, 2 = optimizer_step, 3 = evaluate, 4 = accumulate_gradients.
JNI_FN(jdoubleArray, trainerRun)(JNIEnv* env, jclass, jlong h, jint mode, jintArray ids, jintArray labels,
                                 jlongArray lengths, jobjectArray doc_lengths) {
  GUARD_BEGIN
  JTrainer* jt = T(h);
  sg_trainer* t = jt ? jt->t : nullptr;
  FlatBatch b;
  if (!ReadFlatBatch(env, ids, labels, lengths, doc_lengths, &b)) return nullptr;
  sg_metrics m = sg_metrics_init();
  sg_status* st;
  if (mode == 2) {
    st = sg_trainer_optimizer_step(t, &m);
  } else {
    auto fn = mode == 1   ? sg_trainer_step_batch
              : mode == 3 ? sg_trainer_evaluate_batch
              : mode == 4 ? sg_trainer_accumulate_gradients_batch
                          : sg_trainer_compute_gradients_batch;
    const sg_batch c = b.C();
    st = fn(t, &c, &m);
  }
  return Finish(env, jt, st, m);
  GUARD_END(nullptr)
}

// Per-token log-probs (sg_trainer_score): one per id, NaN where there is no label.
JNI_FN(jdoubleArray, trainerScore)(JNIEnv* env, jclass, jlong h, jintArray ids, jintArray labels,
                                   jlongArray lengths, jobjectArray doc_lengths) {
  GUARD_BEGIN
  FlatBatch b;
  if (!ReadFlatBatch(env, ids, labels, lengths, doc_lengths, &b)) return nullptr;
  std::vector<double> logprobs(std::max<int64_t>(b.ids.size(), 1));  // non-NULL even for an empty (refused) batch
  const sg_batch c = b.C();
  if (Failed(env, sg_trainer_score_batch(T(h) ? T(h)->t : nullptr, &c, logprobs.data(), nullptr))) return nullptr;
  logprobs.resize(b.ids.size());
  return ToJava(env, logprobs);
  GUARD_END(nullptr)
}

// ---- 0.5: LoRA, checkpoints, detailed evaluation ----

JNI_FN(void, modelEnableLora)(JNIEnv* env, jclass, jlong h, jlong rank, jdouble alpha, jdouble dropout,
                              jstring targets, jlong seed) {
  GUARD_BEGIN
  const std::string t = Str(env, targets);
  sg_lora_options o = sg_lora_default_options();
  o.rank = rank;
  o.alpha = alpha;
  o.dropout = dropout;
  o.targets = targets ? t.c_str() : nullptr;  // null: the family's default
  o.seed = static_cast<uint64_t>(seed);
  auto lock = JM(h)->grad_views.Lock();
  if (GradViewsLive(env, JM(h), "Model.enableLora", false)) return;
  Failed(env, sg_model_enable_lora(M(h), &o));
  GUARD_END()
}

// An org.seqgrad.LoraOptions of the model's LoRA, or null without LoRA.
JNI_FN(jobject, modelLora)(JNIEnv* env, jclass, jlong h) {
  GUARD_BEGIN
  sg_lora_options o = sg_lora_default_options();
  if (Failed(env, sg_model_lora(M(h), &o))) return nullptr;
  if (o.rank == 0) return nullptr;
  jclass cls = env->FindClass("org/seqgrad/LoraOptions");
  if (!cls) return nullptr;
  jmethodID ctor = env->GetMethodID(cls, "<init>", "(JDDLjava/lang/String;J)V");
  if (!ctor) return nullptr;
  jstring targets = env->NewStringUTF(o.targets ? o.targets : "");
  return env->NewObject(cls, ctor, static_cast<jlong>(o.rank), o.alpha, o.dropout, targets,
                        static_cast<jlong>(o.seed));
  GUARD_END(nullptr)
}

JNI_FN(void, modelSaveLoraAdapter)(JNIEnv* env, jclass, jlong h, jstring dir, jstring base) {
  GUARD_BEGIN
  const std::string d = Str(env, dir), b = Str(env, base);
  Failed(env, sg_model_save_lora_adapter(M(h), dir ? d.c_str() : nullptr, base ? b.c_str() : nullptr));
  GUARD_END()
}

JNI_FN(void, modelLoadLoraAdapter)(JNIEnv* env, jclass, jlong h, jstring dir) {
  GUARD_BEGIN
  const std::string d = Str(env, dir);
  auto lock = JM(h)->grad_views.Lock();
  if (GradViewsLive(env, JM(h), "Model.loadLoraAdapter", true)) return;
  Failed(env, sg_model_load_lora_adapter(M(h), dir ? d.c_str() : nullptr));
  GUARD_END()
}

JNI_FN(void, trainerSaveCheckpoint)(JNIEnv* env, jclass, jlong h, jstring out_dir, jlong data_position, jlong keep) {
  GUARD_BEGIN
  const std::string d = Str(env, out_dir);
  Failed(env, sg_trainer_save_checkpoint(T(h) ? T(h)->t : nullptr, out_dir ? d.c_str() : nullptr, data_position,
                                         keep));
  GUARD_END()
}

// {step, data_position} of a loaded checkpoint.
static jlongArray StepAndPosition(JNIEnv* env, sg_status* st, int64_t step, int64_t position) {
  if (Failed(env, st)) return nullptr;
  jlong v[2] = {static_cast<jlong>(step), static_cast<jlong>(position)};
  jlongArray a = env->NewLongArray(2);
  if (a) env->SetLongArrayRegion(a, 0, 2, v);
  return a;
}

JNI_FN(jlongArray, trainerLoadCheckpoint)(JNIEnv* env, jclass, jlong h, jstring dir) {
  GUARD_BEGIN
  const std::string d = Str(env, dir);
  int64_t step = -1, position = -1;
  sg_status* st = sg_trainer_load_checkpoint(T(h) ? T(h)->t : nullptr, dir ? d.c_str() : nullptr, &step, &position);
  return StepAndPosition(env, st, step, position);
  GUARD_END(nullptr)
}

JNI_FN(jlongArray, trainerResume)(JNIEnv* env, jclass, jlong h, jstring out_dir) {
  GUARD_BEGIN
  const std::string d = Str(env, out_dir);
  int64_t step = -1, position = -1;
  sg_status* st = sg_trainer_resume(T(h) ? T(h)->t : nullptr, out_dir ? d.c_str() : nullptr, &step, &position);
  return StepAndPosition(env, st, step, position);
  GUARD_END(nullptr)
}

// [sequences, tokens, loss, perplexity, correct, accuracy, peak_bytes, seconds, n, count x n, correct x n, loss x n]
// (EvalResult.java reads this layout).
JNI_FN(jdoubleArray, trainerEvaluateDetailed)(JNIEnv* env, jclass, jlong h, jintArray ids, jintArray labels,
                                              jlongArray lengths, jlongArray distances, jobjectArray doc_lengths) {
  GUARD_BEGIN
  FlatBatch b;
  if (!ReadFlatBatch(env, ids, labels, lengths, doc_lengths, &b)) return nullptr;
  const Copied<int64_t> dist = Copy<int64_t>(env, distances, &JNIEnv::GetLongArrayRegion);
  if (!AlignedWithIds(env, b, dist.present, dist.size(), "distances")) return nullptr;
  sg_eval_result r = sg_eval_result_init();
  const sg_batch c = b.C();
  if (Failed(env, sg_trainer_evaluate_detailed_batch(T(h) ? T(h)->t : nullptr, &c, dist.data(), &r)))
    return nullptr;
  std::vector<jdouble> v = {static_cast<double>(r.sequences), static_cast<double>(r.tokens), r.loss, r.perplexity,
                            static_cast<double>(r.correct), r.accuracy, static_cast<double>(r.peak_bytes), r.seconds,
                            static_cast<double>(r.num_buckets)};
  for (int64_t k = 0; k < r.num_buckets; ++k) v.push_back(static_cast<double>(r.bucket_count[k]));
  for (int64_t k = 0; k < r.num_buckets; ++k) v.push_back(static_cast<double>(r.bucket_correct[k]));
  for (int64_t k = 0; k < r.num_buckets; ++k) v.push_back(r.bucket_loss[k]);
  return ToJava(env, v);
  GUARD_END(nullptr)
}
