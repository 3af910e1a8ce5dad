// The meta backend (Device::kMeta): every op does nothing, so a step on meta tensors only allocates and frees,
// with the byte accounting of the CPU backend (core/plan.h walks a run's memory this way).
#pragma once

#include "kernels/backend.h"

namespace sg::meta {

// Ops that return nothing, zero counts and losses; the workspace sizes (attention's, gated delta's, SSD's) are the CPU
// backend's, so that the workspace category matches a CPU run exactly.
template <typename T>
const OpTable<T>& MetaOps();
// Host "memory" for offloaded pages: counted by the caller (KvOffload), never allocated; copies do nothing.
CopyEngine MetaCopyEngine();
DeviceBackend MetaBackend();

}  // namespace sg::meta
