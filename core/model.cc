#include "core/model.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace sg {

DType Model::activation_dtype() {
  for (const Param& p : params())
    if (p.value.dtype() == DType::kBF16) return DType::kBF16;
  return dtype();
}

DType CreatedDType(Model& model) { return model.activation_dtype(); }

absl::Status CheckDevice(Device d) {
  const std::string why = DeviceUnavailableReason(d);
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("device '", DeviceName(d), "' cannot run: ", why));
}

absl::StatusOr<Device> ParseDevice(const std::string& name) {
  if (name == "cpu") return Device::kCPU;
  if (name == "cuda") return Device::kCUDA;
  if (name == "meta") return Device::kMeta;
  return absl::InvalidArgumentError(absl::StrCat("--device: unknown device '", name, "' (choose cpu, cuda or meta)"));
}

const char* DeviceName(Device d) { return d == Device::kCUDA ? "cuda" : d == Device::kMeta ? "meta" : "cpu"; }

int64_t DocumentStart(const std::vector<int64_t>& doc_starts, int64_t pos) {
  auto it = std::upper_bound(doc_starts.begin(), doc_starts.end(), pos);
  return it == doc_starts.begin() ? 0 : *(it - 1);
}

std::vector<Chunk> SplitAtDocuments(Chunk c, const std::vector<int64_t>& doc_starts) {
  std::vector<Chunk> pieces;
  int64_t begin = c.begin;
  for (auto it = std::upper_bound(doc_starts.begin(), doc_starts.end(), c.begin); it != doc_starts.end() && *it < c.end;
       ++it) {
    pieces.push_back({begin, *it});
    begin = *it;
  }
  pieces.push_back({begin, c.end});
  return pieces;
}

bool StartsDocument(const std::vector<int64_t>& doc_starts, int64_t b) {
  return b == 0 || std::binary_search(doc_starts.begin(), doc_starts.end(), b);
}

std::vector<ChunkPiece> DocumentPieces(Chunk c, const std::vector<int64_t>& doc_starts) {
  const std::vector<Chunk> chunks = SplitAtDocuments(c, doc_starts);
  std::vector<ChunkPiece> pieces;
  for (size_t i = 0; i < chunks.size(); ++i)
    pieces.push_back({chunks[i].begin - c.begin, chunks[i].size(), i == 0, i + 1 == chunks.size()});
  return pieces;
}

bool KeepsStateAfter(const StateOptions& o, Chunk c) {
  return (o.seq_len <= 0 || c.end < o.seq_len) && !StartsDocument(o.doc_starts, c.end);
}

void ScaleTensor(Tensor& t, double f) {
  if (!t.defined() || t.device() == Device::kMeta) return;  // meta tensors hold no values
  if (!HostAddressable(t.device())) {
    if (t.dtype() == DType::kF64)
      OpsFor<double>(t.device()).scale(t.data<double>(), t.numel(), f);
    else
      OpsFor<float>(t.device()).scale(t.data<float>(), t.numel(), f);
    return;
  }
  if (t.dtype() == DType::kF64)
    for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] *= f;
  else
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] *= static_cast<float>(f);
}

int64_t LongestDocument(const std::vector<int64_t>& doc_starts, int64_t seq_len) {
  if (seq_len <= 0) return 0;
  int64_t longest = seq_len + 1 - DocumentStart(doc_starts, seq_len - 1);  // the last one has the label-only token
  for (size_t d = 0; d + 1 < doc_starts.size(); ++d) longest = std::max(longest, doc_starts[d + 1] - doc_starts[d]);
  return longest;
}

void ZeroGrads(Model& model) {
  for (Param& p : model.params())
    if (p.grad.defined()) p.grad.SetZero();
}

Tensor Model::NewRows(int64_t rows) {
  return Tensor::Empty(&memory(), MemCategory::kActivations, activation_dtype(), {rows, hidden_size()});
}

Tensor Model::NewGradRows(int64_t rows) {
  return Tensor::Empty(&memory(), MemCategory::kActivations, dtype(), {rows, hidden_size()});
}

void Model::StoreRows(Tensor& dst, Chunk c, const Tensor& src) {
  Tensor rows = dst.Rows(c.begin, c.end);
  if (dst.dtype() == src.dtype()) {
    CopyTensor(rows, src);  // on the tensors' device; meta: nothing
    return;
  }
  if (dst.dtype() != DType::kBF16 || src.dtype() != DType::kF32)
    throw std::logic_error(
        absl::StrCat("StoreRows: ", DTypeName(src.dtype()), " rows into a ", DTypeName(dst.dtype()), " tensor"));
  OpsFor<float>(src.device()).f32_to_bf16(src.data<float>(), src.numel(), rows.data<uint16_t>());
}

Tensor Model::ReadRows(const Tensor& src, Chunk c) {
  Tensor rows = src.Rows(c.begin, c.end);
  if (src.dtype() == dtype()) return rows;
  Tensor wide = Tensor::Empty(&memory(), MemCategory::kActivations, dtype(), rows.shape());
  OpsFor<float>(src.device()).bf16_to_f32(rows.data<uint16_t>(), rows.numel(), wide.data<float>());
  return wide;
}

Tensor Model::KeepRows(const Tensor& x) {
  if (activation_dtype() == x.dtype()) return x;
  Tensor kept = NewRows(x.dim(0));
  StoreRows(kept, {0, x.dim(0)}, x);
  return kept;
}

namespace {
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// A standard normal draw that is a function of (key, i) alone (Box-Muller over two hashed uniforms in (0, 1)).
double NormalAt(uint64_t key, uint64_t i) {
  const uint64_t h1 = SplitMix64(key ^ SplitMix64(2 * i)), h2 = SplitMix64(key ^ SplitMix64(2 * i + 1));
  const double u1 = (static_cast<double>(h1 >> 11) + 0.5) * 0x1.0p-53, u2 = static_cast<double>(h2 >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}
}  // namespace

// Models up to opts.sequential_limit (2^28) parameters draw from one sequential stream, the values every earlier
// version gave (and the tests' tolerances were set on). Larger ones (a 7B model is 7.6e9 draws, minutes from one
// stream) draw each value as a function of (seed, parameter, index) alone, in parallel. Either way every device gets
// the same values.
void InitRandom(Model& model, const InitOptions& opts) {
  int64_t total = 0;
  for (const Param& p : model.params()) total += p.value.numel();
  std::mt19937_64 rng(opts.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<Param>& params = model.params();
  for (size_t k = 0; k < params.size(); ++k) {
    Param& p = params[k];
    const bool is_vector = p.value.shape().size() == 1;
    const bool is_norm = p.name.find("norm") != std::string::npos;
    const bool drawn = !is_vector || opts.perturb_norms_and_biases;  // else norms are 1, biases 0
    const double mean = is_vector && is_norm ? 1.0 : 0.0, stddev = is_vector ? 0.1 : opts.stddev;
    if (total <= opts.sequential_limit) {
      SetFromHost(p.value, [&](int64_t) { return drawn ? mean + stddev * normal(rng) : mean; });
      continue;
    }
    const uint64_t key = SplitMix64(SplitMix64(opts.seed) ^ k);
    FillFromHost(p.value, [&](void* dst) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < p.value.numel(); ++i)
        StoreAs(p.value.dtype(), dst, i, drawn ? mean + stddev * NormalAt(key, i) : mean);
      return absl::OkStatus();
    }).IgnoreError();  // this fill cannot fail
  }
}

}  // namespace sg
