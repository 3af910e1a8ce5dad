// Step metrics: the engine's StepMetrics and memory snapshot into sg_metrics, field by field as its size allows.
#include "cabi/internal.h"

namespace sg::cabi {

sg_status* CheckMetrics(const char* fn, const sg_metrics* out) {
  if (!out) return nullptr;
  return CheckStructSize(fn, "out", out->struct_size, sizeof(sg_metrics), kMetricsSizes);
}

void FillMetrics(const StepMetrics& m, const sg_trainer* t, double seconds, sg_metrics* out) {
  if (!out) return;
  const int64_t step = t->trainer->step();
  const MemorySnapshot snap = t->trainer->model().memory().Snapshot();
  out->loss = m.loss;
  out->tokens = m.tokens;
  out->grad_norm = m.grad_norm;
  out->step = step;
  out->peak_bytes = snap.total_peak;
  for (int i = 0; i < SG_NUM_MEMORY_CATEGORIES; ++i) {
    out->peak_bytes_by_category[i] = snap.peak[i];
    out->bytes_at_peak_by_category[i] = snap.at_total_peak[i];
  }
  out->seconds = seconds;
  if (out->struct_size > kMetricsSize0_1) {
    out->chunks = m.chunks;
    out->chunks_backpropagated = m.chunks_backpropagated;
  }
  if (out->struct_size > kMetricsSize0_3) out->adjoint_pairs = m.adjoint_pairs;
  if (out->struct_size > kMetricsSize0_4) {
    out->lr = m.lr;
    out->micro_batches = m.micro_batches;
  }
  if (out->struct_size > kMetricsSize0_6) {
    out->peak_bytes_master_weights = snap.peak[SG_MEMORY_CATEGORY_MASTER_WEIGHTS];
    out->bytes_at_peak_master_weights = snap.at_total_peak[SG_MEMORY_CATEGORY_MASTER_WEIGHTS];
  }
  if (out->struct_size > kMetricsSize0_7) {
    out->tp = t->tp ? t->tp->grid.tp->size() : 1;
    out->tp_bytes_reduced = t->tp ? t->tp->bytes_last_call : 0;
  }
}

}  // namespace sg::cabi

extern "C" sg_metrics sg_metrics_init(void) {
  sg_metrics m{};
  m.struct_size = sizeof(sg_metrics);
  return m;
}
