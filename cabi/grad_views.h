// The rule every binding keeps about views of a model's gradients. A binding hands out views of the gradient memory
// sg_param_info.grad points to (numpy arrays, Java direct buffers) that a program may read at any later time, but
// enabling LoRA releases the base parameters' gradients (seqgrad.h): so each binding counts its live views per model
// and refuses a call that enables LoRA while any is alive, with the same FAILED_PRECONDITION message.
#ifndef SEQGRAD_CABI_GRAD_VIEWS_H_
#define SEQGRAD_CABI_GRAD_VIEWS_H_

#include <cstdint>
#include <mutex>
#include <string>

#include "seqgrad/seqgrad.h"

namespace sg::cabi {

class GradViews {
 public:
  // Hold it while handing out a view (Retain) or making a LoRA call, so that the two cannot interleave.
  std::unique_lock<std::mutex> Lock() { return std::unique_lock<std::mutex>(mu_); }
  void Retain() { ++live_; }  // with Lock() held
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    --live_;
  }
  int64_t Live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }

  // With Lock() held, before a call that enables LoRA on `model` (enable_lora; load_lora_adapter when the model has
  // no LoRA yet): "" when no view is alive, else the refusal naming the binding's `call` and its `views` (what the
  // language calls them, e.g. "numpy view(s) of the model's gradients (Model.gradients())").
  std::string LoraRefusal(sg_model* model, const char* call, bool enables_only_without_lora, const char* views) const {
    if (live_ == 0) return "";
    if (enables_only_without_lora) {
      sg_lora_options o = sg_lora_default_options();
      if (sg_status* st = sg_model_lora(model, &o)) {
        sg_status_free(st);  // the call itself reports it
        return "";
      }
      if (o.rank != 0) return "";  // LoRA is on already: the base gradients are gone, no view of them is live
    }
    return std::string(call) + ": " + std::to_string(live_) + " " + views +
           " are alive; LoRA releases the base parameters' gradients: drop the views (or enable LoRA before taking "
           "them)";
  }

 private:
  std::mutex mu_;
  int64_t live_ = 0;
};

}  // namespace sg::cabi

#endif  // SEQGRAD_CABI_GRAD_VIEWS_H_
