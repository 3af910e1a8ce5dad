// A sum of token losses that may still be on the device (issue 19): host terms, then the partial sums the loss
// kernels left in device memory. Strategies add these up inside a step without waiting for the device; reading the
// value copies the partials back, so the trainer reads it once the step's device work is done.
#pragma once

#include <vector>

#include "base/tensor.h"

namespace sg {

class LossSum {
 public:
  LossSum(double host = 0) : host_(host) {}  // NOLINT: a plain sum of host terms converts implicitly

  LossSum& operator+=(double term) {
    host_ += term;
    return *this;
  }
  LossSum& operator+=(const LossSum& other) {
    host_ += other.host_;
    partials_.insert(partials_.end(), other.partials_.begin(), other.partials_.end());
    return *this;
  }
  // A new partial: one zeroed f64 on device d that device work queued before the value is read adds into. Its
  // bytes are counted apart from the model's memory: one is kept per chunk until the step's end, and 8 bytes a chunk
  // in the model's accounting would make a step's peak grow with the sequence's length.
  double* NewPartial(Device d) {
    static MemoryTracker* trackers = [] {
      auto* t = new MemoryTracker[kNumDevices];  // outlives every partial
      for (int i = 0; i < kNumDevices; ++i) t[i].set_device(static_cast<Device>(i));
      return t;
    }();
    partials_.push_back(Tensor::Zeros(&trackers[static_cast<int>(d)], MemCategory::kWorkspace, DType::kF64, {1}));
    return partials_.back().data<double>();
  }

  // The host terms, then each partial in the order added: the bits a host sum in that order gives. Meta partials
  // hold no values and add nothing.
  double value() const {
    double sum = host_;
    for (const Tensor& t : partials_) {
      if (t.device() == Device::kMeta) continue;
      double v = 0;
      CopyToHost(t, &v);
      sum += v;
    }
    return sum;
  }
  operator double() const { return value(); }  // NOLINT: reads the device; code inside a chunk adds, never reads

 private:
  double host_ = 0;
  std::vector<Tensor> partials_;
};

}  // namespace sg
