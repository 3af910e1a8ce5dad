// Statuses: making them from the core's, and the C functions that read them.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cabi/internal.h"
#include "core/io/file.h"

namespace sg::cabi {

sg_status* OutOfMemoryStatus() {
  static sg_status* oom = new sg_status{SG_ERR_RESOURCE_EXHAUSTED, "out of memory"};
  return oom;
}

sg_status* MakeStatus(int code, std::string message) {
  try {
    return new sg_status{code, std::move(message)};
  } catch (...) {
    return OutOfMemoryStatus();
  }
}
sg_status* Invalid(std::string message) { return MakeStatus(SG_ERR_INVALID_ARGUMENT, std::move(message)); }

// "--chunk" becomes "options->chunk", "--lora_rank" "options->rank" (sg_lora_options), "--x=v" "options->x = v",
// "--dtype" "argument 'dtype'". Other "--" words (e.g. a build flag) stay.
std::string FieldMessage(absl::string_view message) {
  static const char* const kFields[] = {
      "strategy",       "chunk",          "page_size",    "lm_chunk",      "spaco_budget", "spaco_cap",
      "seed",           "objective",      "dpo_beta",     "grpo_clip_eps", "grpo_kl_beta", "adjoint_form",
      "adjoint_window", "lr_schedule",    "warmup_steps", "min_lr",        "total_steps",  "grad_accum",
      "sparse_pages",   "offload",        "lr",           "beta1",         "beta2",        "eps",
      "weight_decay",   "clip_grad_norm", "tp",           "lora_rank",     "lora_alpha",   "lora_dropout",
      "lora_targets",   "offload_experts"};
  std::string out;
  size_t i = 0;
  while (i < message.size()) {
    const size_t dash = message.find("--", i);
    if (dash == absl::string_view::npos) break;
    size_t end = dash + 2;
    while (end < message.size() && (absl::ascii_isalnum(message[end]) || message[end] == '_')) ++end;
    const absl::string_view name = message.substr(dash + 2, end - dash - 2);
    absl::StrAppend(&out, message.substr(i, dash - i));
    i = end;
    if (name == "model" && end < message.size() && message[end] == '=') {  // a hint naming a preset
      absl::StrAppend(&out, "preset ");
      ++i;
      continue;
    }
    if (name == "dtype") {  // the argument of sg_model_create_preset / sg_model_load
      absl::StrAppend(&out, "argument 'dtype'");
      if (end < message.size() && message[end] == '=') {
        absl::StrAppend(&out, " = ");
        ++i;
      }
      continue;
    }
    bool known = false;
    for (const char* f : kFields) known |= name == f;
    if (!known) {
      absl::StrAppend(&out, message.substr(dash, end - dash));
      continue;
    }
    absl::StrAppend(&out, "options->", absl::StartsWith(name, "lora_") ? name.substr(5) : name);
    if (end < message.size() && message[end] == '=') {
      absl::StrAppend(&out, " = ");
      ++i;
    }
  }
  absl::StrAppend(&out, message.substr(std::min(i, message.size())));
  return out;
}

sg_status* FromAbsl(const absl::Status& s) {
  if (s.ok()) return nullptr;
  return MakeStatus(static_cast<int>(s.code()), FieldMessage(s.message()));
}

sg_status* FromAbslIn(const char* fn, const absl::Status& s) {
  if (s.ok()) return nullptr;
  return MakeStatus(static_cast<int>(s.code()), absl::StrCat(fn, ": ", FieldMessage(s.message())));
}

sg_status* NullArg(const char* fn, const char* arg) {
  return Invalid(absl::StrCat(fn, ": argument '", arg, "' is NULL"));
}

sg_status* Busy(const char* fn) {
  return MakeStatus(SG_ERR_BUSY, absl::StrCat(fn,
                                              ": the trainer (or its model) is in use by another call; "
                                              "a trainer runs one step at a time"));
}

sg_status* Cancelled(const char* fn) { return MakeStatus(SG_ERR_CANCELLED, absl::StrCat(fn, ": cancelled")); }

sg_status* CheckDirectory(const char* fn, const char* arg, const char* path) {
  const std::string what = absl::StrCat(fn, ": argument '", arg, "' ('", path, "') is not a directory");
  struct stat st;
  if (stat(path, &st) != 0) return FromAbsl(sg::ErrnoStatus(errno, what));
  if (!S_ISDIR(st.st_mode)) return MakeStatus(SG_ERR_NOT_FOUND, what);
  return nullptr;
}

sg_status* CheckStructSize(const char* fn, const char* arg, size_t got, size_t want,
                           absl::Span<const PublishedSize> older) {
  if (got >= want) return nullptr;
  std::string sizes;
  for (const PublishedSize& p : older) {
    if (got == p.size) return nullptr;
    absl::StrAppend(&sizes, sizes.empty() ? " and not the " : " or the ", p.version, " size ", p.size);
  }
  return Invalid(absl::StrCat(fn, ": ", arg, "->struct_size is ", got, ", smaller than this library's ", want, sizes,
                              " (initialise it with the matching *_init()/*_default_options())"));
}

}  // namespace sg::cabi

using sg::cabi::OutOfMemoryStatus;

extern "C" {

const char* sg_version(void) { return SG_VERSION_STRING; }

int sg_status_code(const sg_status* status) { return status ? status->code : SG_OK; }
const char* sg_status_message(const sg_status* status) { return status ? status->message.c_str() : ""; }
void sg_status_free(sg_status* status) {
  if (status != OutOfMemoryStatus()) delete status;
}

const char* sg_code_name(int code) {
  switch (code) {
    case SG_OK:
      return "OK";
    case SG_ERR_CANCELLED:
      return "CANCELLED";
    case SG_ERR_UNKNOWN:
      return "UNKNOWN";
    case SG_ERR_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case SG_ERR_DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case SG_ERR_NOT_FOUND:
      return "NOT_FOUND";
    case SG_ERR_ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case SG_ERR_PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case SG_ERR_RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case SG_ERR_FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case SG_ERR_ABORTED:
      return "ABORTED";
    case SG_ERR_OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case SG_ERR_UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case SG_ERR_INTERNAL:
      return "INTERNAL";
    case SG_ERR_UNAVAILABLE:
      return "UNAVAILABLE";
    case SG_ERR_DATA_LOSS:
      return "DATA_LOSS";
    case SG_ERR_UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case SG_ERR_BUSY:
      return "BUSY";
  }
  return "UNKNOWN_CODE";
}

}  // extern "C"
