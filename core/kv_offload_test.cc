// KV offload (StateOptions::offload, core/kv_offload.h) on the CPU backend: the bookkeeping on its own against a
// copy engine that delays every copy as long as it may, then seco --offload against seco (f64, f32, bf16 pages,
// LoRA, sparse pages, attention streamed through the ring in page groups).
#include "core/kv_offload.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <iostream>

#include "core/lora.h"
#include "core/models/mamba/mamba.h"
#include "core/models/transformer/transformer.h"
#include "core/paged_attention.h"
#include "core/test_batches.h"
#include "core/trainer.h"

namespace sg {
namespace {

// A copy engine that runs a lane's copies only when the lane is waited for: a missing wait shows up as wrong or
// missing data.
struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};
std::deque<Copy> g_lanes[2];

CopyEngine LazyCopyEngine() {
  CopyEngine e;
  e.alloc_host = [](size_t bytes) -> void* { return new char[bytes]; };
  e.free_host = [](void* p) { delete[] static_cast<char*>(p); };
  e.copy_async = [](void* dst, const void* src, size_t bytes, int lane) { g_lanes[lane].push_back({dst, src, bytes}); };
  e.wait = [](int lane) {
    for (const Copy& c : g_lanes[lane]) std::memcpy(c.dst, c.src, c.bytes);
    g_lanes[lane].clear();
  };
  return e;
}

// A distinct value for each (layer, row, element, K or V).
double Value(int layer, int64_t row, int64_t e, bool v) { return layer * 1000 + row * 10 + e + (v ? 0.5 : 0); }

// Appends rows c of `layer` to its pages (row_elems elements each), with their Values.
void Append(PagePool& kv, int layer, Chunk c, int64_t row_elems) {
  kv.Ensure(layer, c.begin, c.end, /*zero_new=*/false);
  std::vector<double> k, v;
  for (int64_t t = c.begin; t < c.end; ++t)
    for (int64_t e = 0; e < row_elems; ++e) {
      k.push_back(Value(layer, t, e, false));
      v.push_back(Value(layer, t, e, true));
    }
  kv.Scatter<double>(layer, c.begin, c.end, k.data(), v.data());
}

// Stage 1 of seco by hand over 6 layers, 3 slots: chunks [0, 4), [4, 8), [8, 10), each layer appending its rows.
// Every layer's rows survive eviction, the device never holds more than 3 layers, and only what is needed moves:
// each visit fetches the rows before its chunk once, and every appended row goes home once (but the last
// visit's, still on the device).
TEST(KvOffloadTest, ForwardSweepMovesOnlyWhatIsNeeded) {
  constexpr int kLayers = 6;
  constexpr int64_t kSeqLen = 10, kPage = 4, kHeadDim = 2;
  const int64_t pages_per_layer = (kSeqLen + kPage - 1) / kPage;
  PagePool kv(nullptr, MemCategory::kKVCache, DType::kF64, 3 * pages_per_layer, kPage, /*kv_heads=*/1, kHeadDim);
  KvOffload offload(kv, /*grad=*/nullptr, LazyCopyEngine(), kLayers, kSeqLen);
  const std::vector<Chunk> chunks = SplitIntoChunks(kSeqLen, 4);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk c = chunks[i];
    for (int l = 0; l < kLayers; ++l) {
      LayerAccess now{l, c.begin, c, 0, {}}, next;
      if (l + 1 < kLayers)
        next = {l + 1, c.begin, {}, 0, {}};
      else if (i + 1 < chunks.size())
        next = {0, c.end, {}, 0, {}};  // layer 0 of the next chunk
      offload.Visit(now, next);
      Append(kv, l, c, kHeadDim);
      int resident = 0;
      for (int j = 0; j < kLayers; ++j) resident += offload.resident(j);
      EXPECT_LE(resident, 3);
    }
  }
  const int64_t row_bytes = 2 * kHeadDim * sizeof(double);  // K and V
  EXPECT_EQ(offload.fetched_bytes(), kLayers * (0 + 4 + 8) * row_bytes);
  EXPECT_EQ(offload.written_back_bytes(), (kLayers * kSeqLen - 2) * row_bytes);
  EXPECT_EQ(offload.host_bytes(), kLayers * pages_per_layer * kPage * row_bytes);

  for (int l = 0; l < kLayers; ++l) {
    offload.Visit({l, kSeqLen, {}, 0, {}}, {});
    std::vector<double> k(kSeqLen * kHeadDim), v(kSeqLen * kHeadDim);
    kv.Gather<double>(l, 0, kSeqLen, k.data(), v.data());
    for (int64_t t = 0; t < kSeqLen; ++t)
      for (int64_t e = 0; e < kHeadDim; ++e) {
        ASSERT_EQ(k[t * kHeadDim + e], Value(l, t, e, false)) << "layer " << l << " row " << t;
        ASSERT_EQ(v[t * kHeadDim + e], Value(l, t, e, true)) << "layer " << l << " row " << t;
      }
  }
}

// seco's visits by hand over 6 layers and chunks [0, 4), [4, 8) (pages of 3 rows, not dividing the chunk):
// stage 1 forward of the first chunk, then per chunk in reverse the forward with graph, the backward (each adds
// layer + 1 to every gradient row of [0, chunk end)) and the release of the chunk. The gradients of the first
// chunk's rows have both chunks' contributions, through evictions of K/V and gradient pages.
TEST(KvOffloadTest, BackwardSweepAccumulatesGradientsAtHome) {
  constexpr int kLayers = 6;
  constexpr int64_t kSeqLen = 8, kPage = 3, kRow = 2;  // 1 KV head of 2 dims
  const int64_t pages_per_layer = (kSeqLen + kPage - 1) / kPage;
  PagePool kv(nullptr, MemCategory::kKVCache, DType::kF64, 3 * pages_per_layer, kPage, 1, kRow);
  PagePool grad(nullptr, MemCategory::kKVGrad, DType::kF64, 3 * pages_per_layer, kPage, 1, kRow);
  KvOffload offload(kv, &grad, LazyCopyEngine(), kLayers, kSeqLen);
  auto append = [&](int l, Chunk c) { Append(kv, l, c, kRow); };
  const Chunk first{0, 4}, last{4, 8};
  for (int l = 0; l < kLayers; ++l) {
    offload.Visit({l, 0, first, 0, {}}, {l + 1 < kLayers ? l + 1 : 0, l + 1 < kLayers ? 0 : first.end, {}, 0, {}});
    append(l, first);
  }
  for (const Chunk c : {last, first}) {
    // The last chunk's K/V are appended by its recompute; the first chunk's are in the cache already.
    const Chunk appended = c.begin == last.begin ? last : Chunk{};
    const int64_t kv_rows = appended.size() > 0 ? c.begin : c.end;
    for (int l = 0; l < kLayers; ++l) {
      // After the last layer's forward comes its backward.
      const LayerAccess next =
          l + 1 < kLayers ? LayerAccess{l + 1, kv_rows, {}, 0, {}} : LayerAccess{l, kv_rows, {}, c.end, {}};
      offload.Visit({l, kv_rows, appended, 0, {}}, next);
      if (appended.size() > 0) append(l, appended);
      std::vector<double> k(c.end * kRow), v(c.end * kRow);
      kv.Gather<double>(l, 0, c.end, k.data(), v.data());
      for (int64_t t = 0; t < c.end; ++t) ASSERT_EQ(v[t * kRow + 1], Value(l, t, 1, true)) << l << " " << t;
    }
    for (int l = kLayers - 1; l >= 0; --l) {
      offload.Visit({l, c.end, {}, c.end, {}}, l > 0 ? LayerAccess{l - 1, c.end, {}, c.end, {}} : LayerAccess{});
      grad.Ensure(l, 0, c.end, /*zero_new=*/true);
      std::vector<double> dk(c.end * kRow), dv(c.end * kRow);
      grad.Gather<double>(l, 0, c.end, dk.data(), dv.data());
      for (double& x : dk) x += l + 1;
      for (double& x : dv) x += l + 1;
      grad.Scatter<double>(l, 0, c.end, dk.data(), dv.data());
    }
    if (c.begin == 0) break;  // keep the first chunk's gradients to read them back
    for (int l = 0; l < kLayers; ++l) {
      offload.Release(l, c.begin);
      kv.Release(l, c.begin);
      grad.Release(l, c.begin);
    }
  }
  for (int l = 0; l < kLayers; ++l) {
    offload.Visit({l, first.end, {}, first.end, {}}, {});
    std::vector<double> dk(first.end * kRow), dv(first.end * kRow);
    grad.Gather<double>(l, 0, first.end, dk.data(), dv.data());
    for (int64_t i = 0; i < first.end * kRow; ++i) {
      ASSERT_EQ(dk[i], 2.0 * (l + 1)) << "layer " << l << " element " << i;
      ASSERT_EQ(dv[i], 2.0 * (l + 1)) << "layer " << l << " element " << i;
    }
  }
}

// Sparse attention's visits (LayerAccess::pages): only the selected pages move to the device, pages a visit does
// not read leave it, and gradient pages come back only where home holds them.
TEST(KvOffloadTest, SparseVisitsMoveOnlySelectedPages) {
  constexpr int kLayers = 4;
  constexpr int64_t kSeqLen = 16, kPage = 2, kRow = 2;  // 8 pages; 1 KV head of 2 dims
  const int64_t row_bytes = 2 * kRow * sizeof(double);  // K and V
  PagePool kv(nullptr, MemCategory::kKVCache, DType::kF64, 3 * 8, kPage, 1, kRow);
  PagePool grad(nullptr, MemCategory::kKVGrad, DType::kF64, 3 * 8, kPage, 1, kRow);
  KvOffload offload(kv, &grad, LazyCopyEngine(), kLayers, kSeqLen);
  for (int l = 0; l < kLayers; ++l) {  // every layer appends all its rows; the sweep leaves layer 0 at home only
    offload.Visit({l, 0, {0, kSeqLen}, 0, {}}, l + 1 < kLayers ? LayerAccess{l + 1, 0, {}, 0, {}} : LayerAccess{});
    Append(kv, l, {0, kSeqLen}, kRow);
  }
  ASSERT_FALSE(offload.resident(0));
  auto resident_pages = [](const PagePool& pool, int l) {
    std::vector<int64_t> pages;
    for (int64_t p = 0; p < pool.pages(l); ++p)
      if (pool.pool_page(l, p) >= 0) pages.push_back(p);
    return pages;
  };
  auto mask = [](std::initializer_list<int> pages) {
    std::vector<uint8_t> m(8, 0);
    for (int p : pages) m[p] = 1;
    return m;
  };
  // Layer 0 reads pages 0, 3, 7 of its 16 rows (the last page, its chunk's, is always read): 3 pages move.
  int64_t fetched = offload.fetched_bytes();
  offload.Visit({0, kSeqLen, {}, 0, mask({0, 3, 7})}, {});
  EXPECT_EQ(offload.fetched_bytes() - fetched, 3 * kPage * row_bytes);
  EXPECT_EQ(resident_pages(kv, 0), (std::vector<int64_t>{0, 3, 7}));
  std::vector<double> k(kSeqLen * kRow), v(kSeqLen * kRow);
  kv.Gather<double>(0, 0, kSeqLen, k.data(), v.data());
  for (int64_t t = 0; t < kSeqLen; ++t) {
    const bool selected = t / kPage == 0 || t / kPage == 3 || t / kPage == 7;
    EXPECT_EQ(v[t * kRow + 1], selected ? Value(0, t, 1, true) : 0.0) << "row " << t;
  }
  // Then pages 0, 5, 7: one page moves, page 3 leaves the device.
  fetched = offload.fetched_bytes();
  offload.Visit({0, kSeqLen, {}, 0, mask({0, 5, 7})}, {});
  EXPECT_EQ(offload.fetched_bytes() - fetched, 1 * kPage * row_bytes);
  EXPECT_EQ(resident_pages(kv, 0), (std::vector<int64_t>{0, 5, 7}));
  // A backward over pages 0, 5, 7 creates (zeroed) and fills only those gradient pages...
  offload.Visit({0, kSeqLen, {}, kSeqLen, mask({0, 5, 7})}, {});
  const std::vector<uint8_t> selected = mask({0, 5, 7});
  grad.Ensure(0, 0, kSeqLen, /*zero_new=*/true, selected.data());
  EXPECT_EQ(resident_pages(grad, 0), (std::vector<int64_t>{0, 5, 7}));
  std::vector<double> ones(kSeqLen * kRow, 1.0);
  grad.Scatter<double>(0, 0, kSeqLen, ones.data(), ones.data());
  // ... which go home when another layer is visited and come back only where they are selected again.
  offload.Visit({1, kSeqLen, {}, 0, mask({0, 7})}, {});
  offload.Visit({0, kSeqLen, {}, kSeqLen, mask({0, 3, 7})}, {});
  EXPECT_EQ(resident_pages(grad, 0), (std::vector<int64_t>{0, 7}));  // page 3 has no gradient at home yet
  grad.Ensure(0, 0, kSeqLen, /*zero_new=*/true, mask({0, 3, 7}).data());
  std::vector<double> dk(kSeqLen * kRow), dv(kSeqLen * kRow);
  grad.Gather<double>(0, 0, kSeqLen, dk.data(), dv.data());
  for (int64_t t = 0; t < kSeqLen; ++t)
    EXPECT_EQ(dk[t * kRow], t / kPage == 0 || t / kPage == 7 ? 1.0 : 0.0) << "row " << t;
  // Page 5's gradient is at home, not lost: selecting it again brings it back.
  offload.Visit({1, kSeqLen, {}, 0, mask({0, 7})}, {});
  offload.Visit({0, kSeqLen, {}, kSeqLen, mask({0, 5, 7})}, {});
  grad.Gather<double>(0, 0, kSeqLen, dk.data(), dv.data());
  for (int64_t t = 0; t < kSeqLen; ++t)
    EXPECT_EQ(dv[t * kRow], t / kPage == 0 || t / kPage == 5 || t / kPage == 7 ? 1.0 : 0.0) << "row " << t;
}

// Dense offload's ring by hand (1 KV head of 2 dims, pages of 2, groups of 2 pages), against the lazy copy engine:
// a layer keeps only its chunk's pages, attention's other pages come through the ring a group at a time with the
// rows home holds, and gradient pages accumulate at home across two backward walks. The pools hold 2 slots of a
// chunk's pages (3) plus the ring (2 groups of K/V, 3 of gradients): an overflow would throw.
TEST(KvOffloadTest, StreamedGroupsComeThroughTheRing) {
  constexpr int kLayers = 2;
  constexpr int64_t kSeqLen = 16, kPage = 2, kRow = 2, kChunk = 4;
  PagePool kv(nullptr, MemCategory::kKVCache, DType::kF64, 2 * 3 + 2 * 2, kPage, 1, kRow);
  PagePool grad(nullptr, MemCategory::kKVGrad, DType::kF64, 2 * 3 + 3 * 2, kPage, 1, kRow);
  KvOffload offload(kv, &grad, LazyCopyEngine(), kLayers, kSeqLen);
  for (const Chunk c : SplitIntoChunks(kSeqLen, kChunk))
    for (int l = 0; l < kLayers; ++l) {
      offload.Visit({l, c.begin, c, 0, KvOffload::ChunkPageMask(c, kPage)}, {});
      Append(kv, l, c, kRow);
    }
  const Chunk last{12, 16};
  const std::vector<std::vector<int64_t>> groups = {{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  // Streams layer 0's groups for the last chunk's backward, adding 1 to every gradient row of each group.
  auto backward_walk = [&]() {
    offload.Visit({0, kSeqLen, {}, kSeqLen, KvOffload::ChunkPageMask(last, kPage)}, {});
    grad.Ensure(0, last.begin, last.end, /*zero_new=*/true);
    offload.StreamGroup(0, groups[0], /*grad=*/true);
    for (size_t i = 0; i < groups.size(); ++i) {
      offload.AwaitGroup();
      if (i + 1 < groups.size()) offload.StreamGroup(0, groups[i + 1], /*grad=*/true);
      const int64_t begin = groups[i].front() * kPage, end = (groups[i].back() + 1) * kPage;
      std::vector<double> k((end - begin) * kRow), v((end - begin) * kRow);
      kv.Gather<double>(0, begin, end, k.data(), v.data());
      for (int64_t t = begin; t < end; ++t) ASSERT_EQ(v[(t - begin) * kRow + 1], Value(0, t, 1, true)) << t;
      std::vector<double> dk((end - begin) * kRow), dv((end - begin) * kRow);
      grad.Gather<double>(0, begin, end, dk.data(), dv.data());
      for (double& x : dk) x += 1;
      for (double& x : dv) x += 1;
      grad.Scatter<double>(0, begin, end, dk.data(), dv.data());
      offload.FinishGroup();
    }
    offload.FlushGroups();
    // Only the chunk's pages stay on the device.
    for (int64_t p = 0; p < 6; ++p) EXPECT_LT(grad.pool_page(0, p), 0) << p;
  };
  backward_walk();
  const int64_t fetched = offload.fetched_bytes();
  backward_walk();
  // The second walk fetches K/V and gradients of the 6 streamed pages, which the first walk sent home.
  EXPECT_EQ(offload.fetched_bytes() - fetched, 2 * 6 * kPage * 2 * kRow * static_cast<int64_t>(sizeof(double)));
  offload.Visit({1, kSeqLen, {}, 0, KvOffload::ChunkPageMask(last, kPage)}, {});  // layer 0's pages go home
  offload.Visit({0, kSeqLen, {}, kSeqLen, KvOffload::ChunkPageMask({0, kSeqLen}, kPage)}, {});
  std::vector<double> dk(kSeqLen * kRow), dv(kSeqLen * kRow);
  grad.Gather<double>(0, 0, kSeqLen, dk.data(), dv.data());
  for (int64_t i = 0; i < kSeqLen * kRow; ++i) ASSERT_EQ(dk[i], 2.0) << "element " << i;
}

std::unique_ptr<TransformerModel> MakeModel(const TransformerConfig& config, DType dtype = DType::kF64,
                                            int lora_rank = 0) {
  auto model = CreateTransformer(config, dtype);
  EXPECT_TRUE(model.ok()) << model.status();
  InitOptions init;
  init.seed = 7;
  init.stddev = 0.3;
  init.perturb_norms_and_biases = true;
  InitRandom(**model, init);
  if (lora_rank > 0) {
    LoraOptions lora;
    lora.rank = lora_rank;
    lora.targets = {"q_proj", "k_proj", "v_proj", "down_proj"};
    lora.dropout = 0.1;
    lora.seed = 3;
    EXPECT_TRUE(EnableLora(**model, lora).ok());
    RandomizeLoraB(**model, 11, 0.2);
  }
  return std::move(*model);
}

// Llama with GQA (4 query heads on 2 KV heads) and `layers` layers.
TransformerConfig Deep(int64_t layers) {
  TransformerConfig c = *TransformerPreset("tiny");
  c.num_layers = layers;
  return c;
}

// group: StrategyOptions::attention_group in tokens (0: the default, one group at these lengths).
StrategyOptions Seco(int64_t chunk, int64_t page, int64_t sparse_pages, bool offload, int64_t group = 0) {
  StrategyOptions o;
  o.name = "seco";
  o.chunk = chunk;
  o.page_size = page;
  o.lm_chunk = 5;
  o.sparse_pages = sparse_pages;
  o.offload = offload;
  o.attention_group = group;
  return o;
}

// Every parameter's gradient widened to double (empty for a frozen base under LoRA).
std::vector<std::vector<double>> Grads(Model& m, const StrategyOptions& o, const std::vector<Sequence>& batch,
                                       StepMetrics* metrics) {
  Trainer t(m, o, {});
  auto r = t.ComputeGradients(batch);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) *metrics = *r;
  std::vector<std::vector<double>> g;
  for (Param& p : m.params()) {
    if (!p.grad.defined())
      g.emplace_back();
    else if (p.grad.dtype() == DType::kF64)
      g.emplace_back(p.grad.data<double>(), p.grad.data<double>() + p.grad.numel());
    else
      g.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  }
  return g;
}

struct Case {
  std::string name;
  TransformerConfig config;
  int64_t chunk, page, sparse_pages;
  int64_t group = 0;  // attention group in tokens
  DType dtype = DType::kF64;
  int lora_rank = 0;
};

class OffloadTest : public ::testing::TestWithParam<Case> {};

// Offload only moves bytes: loss and gradients are bit-identical to seco's with the same attention groups (dense
// offload streams the groups through the ring). The batch has sequences of 23 and 9 tokens, so the last chunk is
// ragged; no page size divides its chunk.
TEST_P(OffloadTest, BitIdenticalToSeco) {
  const Case& c = GetParam();
  auto model = MakeModel(c.config, c.dtype, c.lora_rank);
  const std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 12345);
  StepMetrics plain, offloaded;
  const auto expected = Grads(*model, Seco(c.chunk, c.page, c.sparse_pages, false, c.group), batch, &plain);
  const auto got = Grads(*model, Seco(c.chunk, c.page, c.sparse_pages, true, c.group), batch, &offloaded);
  EXPECT_EQ(offloaded.loss, plain.loss);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], expected[i]) << model->params()[i].name;
  EXPECT_EQ(plain.offloaded_bytes, 0);
  EXPECT_GT(offloaded.offloaded_bytes, 0);
}

Case Grouped(std::string name, TransformerConfig config, int64_t chunk, int64_t page, int64_t group,
             DType dtype = DType::kF64, int lora_rank = 0, int64_t sparse_pages = 0) {
  return Case{std::move(name), std::move(config), chunk, page, sparse_pages, group, dtype, lora_rank};
}

INSTANTIATE_TEST_SUITE_P(
    Exact, OffloadTest,
    ::testing::Values(
        Case{"tiny_chunk4_page3", *TransformerPreset("tiny"), 4, 3, 0},
        Case{"tinyqwen_chunk5_page2", *TransformerPreset("tiny-qwen2"), 5, 2, 0},
        Case{"layers7_chunk4_page3", Deep(7), 4, 3, 0}, Case{"layers7_chunk6_page4", Deep(7), 6, 4, 0},
        Case{"layers8_chunk1_page2", Deep(8), 1, 2, 0}, Case{"layers1_chunk4_page3", Deep(1), 4, 3, 0},
        Case{"layers7_sparse1_chunk4_page2", Deep(7), 4, 2, 1}, Case{"layers7_sparse3_chunk4_page2", Deep(7), 4, 2, 3},
        Case{"layers1_sparse2_chunk3_page2", Deep(1), 3, 2, 2}, Case{"layers2_sparse1_chunk5_page2", Deep(2), 5, 2, 1},
        // Attention in groups of pages, streamed through the ring under dense offload.
        Grouped("tiny_chunk4_page3_group3", *TransformerPreset("tiny"), 4, 3, 3),
        Grouped("tinyqwen_chunk5_page2_group4", *TransformerPreset("tiny-qwen2"), 5, 2, 4),
        Grouped("layers7_chunk4_page2_group4", Deep(7), 4, 2, 4),
        Grouped("layers7_chunk6_page4_group5", Deep(7), 6, 4, 5),
        Grouped("layers8_chunk1_page2_group2", Deep(8), 1, 2, 2),
        Grouped("layers1_chunk4_page3_group6", Deep(1), 4, 3, 6),
        Grouped("f32_layers4_chunk4_page2_group4", Deep(4), 4, 2, 4, DType::kF32),
        Grouped("bf16_layers4_chunk4_page2_group4", Deep(4), 4, 2, 4, DType::kBF16),
        Grouped("f64_lora_layers4_chunk5_page2_group2", Deep(4), 5, 2, 2, DType::kF64, 4),
        Grouped("bf16_lora_layers4_chunk4_page3_group3", Deep(4), 4, 3, 3, DType::kBF16, 4),
        Grouped("sparse2_layers4_chunk4_page2_group4", Deep(4), 4, 2, 4, DType::kF64, 0, 2),
        // A Qwen3.5 hybrid: pages only in its attention layer, numbered among attention layers.
        Case{"qwen35_chunk4_page3", *TransformerPreset("tiny-qwen3.5"), 4, 3, 0},
        Case{"qwen35_sparse1_chunk4_page2", *TransformerPreset("tiny-qwen3.5"), 4, 2, 1},
        Grouped("bf16_lora_qwen35_chunk4_page3_group3", *TransformerPreset("tiny-qwen3.5"), 4, 3, 3, DType::kBF16, 4),
        // Mamba-2 beside attention: the scan states go home with the pages.
        Case{"bamba_chunk4_page3", *TransformerPreset("tiny-bamba"), 4, 3, 0},
        Case{"bamba_sparse1_chunk4_page2", *TransformerPreset("tiny-bamba"), 4, 2, 1},
        Case{"falcon_h1_chunk4_page3", *TransformerPreset("tiny-falcon-h1"), 4, 3, 0},
        Grouped("bf16_lora_bamba_chunk4_page3_group3", *TransformerPreset("tiny-bamba"), 4, 3, 3, DType::kBF16, 4)),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Groups change only the rounding: attention over groups of one page (merged forward, dQ summed over groups)
// against one call over every page, in f64, for dense and sparse attention.
TEST(AttentionGroupsTest, GroupsOfOnePageMatchOneCall) {
  for (int64_t sparse : {0, 2}) {
    auto model = MakeModel(Deep(3));
    const std::vector<Sequence> batch = RaggedBatch(model->vocab_size(), 777);
    StepMetrics one, grouped;
    const auto expected = Grads(*model, Seco(4, 2, sparse, false), batch, &one);
    const auto got = Grads(*model, Seco(4, 2, sparse, false, /*group=*/2), batch, &grouped);
    EXPECT_NEAR(grouped.loss, one.loss, 1e-12 * std::abs(one.loss));
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      double scale = 0, diff = 0;
      for (size_t j = 0; j < got[i].size(); ++j) {
        scale = std::max(scale, std::abs(expected[i][j]));
        diff = std::max(diff, std::abs(got[i][j] - expected[i][j]));
      }
      EXPECT_LE(diff, 1e-11 * std::max(scale, 1e-3)) << model->params()[i].name << " sparse " << sparse;
    }
  }
}

TEST(AttentionGroupsTest, GroupPages) {
  StateOptions o;
  o.page_size = 256;
  EXPECT_EQ(AttentionGroupPages(o), kDefaultAttentionGroup / 256);
  o.attention_group = 1000;  // whole pages
  EXPECT_EQ(AttentionGroupPages(o), 3);
  o.attention_group = 100;  // at least one
  EXPECT_EQ(AttentionGroupPages(o), 1);
  EXPECT_FALSE(ValidateStrategyOptions(Seco(4, 4, 0, false, -1)).ok());
}

struct StateBytes {
  int64_t kv_cache = 0, kv_grad = 0, host = 0;
};

// Peak device bytes of the KV cache and KV gradient over one seco pass (chunk 8, pages of 4, attention groups of 8
// tokens) of a sequence of `tokens`, and the host bytes offload used.
StateBytes Measure(Model& m, bool offload, int64_t tokens = 64, int64_t sparse_pages = 0) {
  Sequence s = RaggedBatch(m.vocab_size(), 99)[0];
  while (static_cast<int64_t>(s.ids.size()) < tokens) {
    s.ids.insert(s.ids.end(), s.ids.begin(), s.ids.end());
    s.labels.insert(s.labels.end(), s.labels.begin(), s.labels.end());
  }
  s.ids.resize(tokens);
  s.labels.resize(tokens);
  m.memory().ResetPeak();
  const GradResult r = ChunkedBackprop(m, s, 1.0, Seco(8, 4, sparse_pages, offload, /*group=*/8));
  const MemorySnapshot snap = m.memory().Snapshot();
  return {snap.peak[static_cast<int>(MemCategory::kKVCache)], snap.peak[static_cast<int>(MemCategory::kKVGrad)],
          r.offloaded_bytes};
}

// The device holds at most KvOffload::kSlots layers' pages: its KV memory is at most that of 3 layers whatever
// the depth, while every layer's pages live in host memory outside the model's tracker.
TEST(OffloadMemoryTest, DeviceBytesFlatInLayers) {
  StateBytes at4, at8;
  for (int64_t layers : {4, 8}) {
    auto model = MakeModel(Deep(layers));
    const StateBytes plain = Measure(*model, false), offloaded = Measure(*model, true);
    std::cout << layers << " layers, 64 tokens: device kv_cache + kv_grad peak " << plain.kv_cache << " + "
              << plain.kv_grad << " B without offload, " << offloaded.kv_cache << " + " << offloaded.kv_grad
              << " B with (host: " << offloaded.host << " B)\n";
    const double bound = static_cast<double>(KvOffload::kSlots) / static_cast<double>(layers);
    EXPECT_LE(offloaded.kv_cache, bound * plain.kv_cache);
    EXPECT_LE(offloaded.kv_grad, bound * plain.kv_grad);
    // K and V of 64 tokens x 2 KV heads x 8 dims in fp64, for the cache and for its gradient, per layer
    EXPECT_EQ(offloaded.host, layers * 2 * 2 * 64 * 2 * 8 * 8);
    (layers == 4 ? at4 : at8) = offloaded;
  }
  EXPECT_EQ(at4.kv_cache, at8.kv_cache);
  EXPECT_EQ(at4.kv_grad, at8.kv_grad);
}

// Device KV pages no longer grow with the sequence (sparse attention's key sums do); host memory does. With sparse
// pages the device holds, per resident layer, only the pages a chunk reads (page 0, k selected, the chunk's and the one
// before); dense, only the chunk's pages per resident layer and the ring of page groups attention streams the others
// through.
TEST(OffloadMemoryTest, DeviceBytesFlatInTokens) {
  auto model = MakeModel(Deep(4));
  const StateBytes plain = Measure(*model, false, 256, 0);
  for (int64_t sparse : {2, 0}) {
    const StateBytes at64 = Measure(*model, true, 64, sparse), at256 = Measure(*model, true, 256, sparse);
    std::cout << "sparse_pages " << sparse << ", offload: device kv_cache + kv_grad peak " << at64.kv_cache << " + "
              << at64.kv_grad << " B at 64 tokens, " << at256.kv_cache << " + " << at256.kv_grad
              << " B at 256 (without offload at 256: " << plain.kv_cache << " + " << plain.kv_grad << " B); host "
              << at64.host << " -> " << at256.host << " B\n";
    // The pages are flat; with sparse pages what grows is the key sums pages are scored by (f64 on the device, per
    // layer, complete page and KV dimension), 1/8 of the pages' bytes here (1/128 for bf16 pages of 256 tokens).
    const auto key_sums = [&](int64_t tokens) { return sparse > 0 ? 4 * (tokens / 4) * 2 * 8 * 8 : 0; };
    EXPECT_EQ(at64.kv_cache - key_sums(64), at256.kv_cache - key_sums(256));
    EXPECT_EQ(at64.kv_grad, at256.kv_grad);
    EXPECT_EQ(at256.host, 4 * at64.host);
    EXPECT_LT(at256.kv_cache - key_sums(256), plain.kv_cache / 4);
    EXPECT_LT(at256.kv_grad, plain.kv_grad / 4);
  }
  // Dense: 3 slots of the chunk's pages (8 / 4 + 1) and a ring of 2 (K/V) or 3 (gradients) groups of 2 pages, of
  // 4 tokens x 2 KV heads x 8 dims x 2 (K and V) in f64.
  const int64_t page_bytes = 4 * 2 * 8 * 2 * 8;
  const StateBytes dense = Measure(*model, true, 256, 0);
  EXPECT_EQ(dense.kv_cache, (3 * 3 + 2 * 2) * page_bytes);
  EXPECT_EQ(dense.kv_grad, (3 * 3 + 3 * 2) * page_bytes);
}

// A hybrid's Gated DeltaNet layers keep a state at every chunk boundary for seco's second pass: with offload these
// wait in host memory like its attention layers' pages, so the device's cache is flat in T while the host's grows.
// Falcon-H1's layers hold attention pages and a Mamba-2 state side by side: both kinds are released.
TEST(OffloadMemoryTest, HybridDeviceBytesFlatInTokens) {
  for (const std::string preset : {"tiny-qwen3.5", "tiny-bamba", "tiny-falcon-h1"}) {
    auto model = MakeModel(*TransformerPreset(preset));
    const StateBytes plain64 = Measure(*model, false, 64), plain256 = Measure(*model, false, 256);
    const StateBytes at64 = Measure(*model, true, 64), at256 = Measure(*model, true, 256);
    std::cout << preset << ": device kv_cache peak " << plain64.kv_cache << " -> " << plain256.kv_cache
              << " B from 64 to 256 tokens without offload, " << at64.kv_cache << " -> " << at256.kv_cache
              << " B with (kv_grad " << at64.kv_grad << " -> " << at256.kv_grad << " B; host " << at64.host << " -> "
              << at256.host << " B)\n";
    EXPECT_GT(plain256.kv_cache, plain64.kv_cache) << preset;
    EXPECT_EQ(at64.kv_cache, at256.kv_cache) << preset;
    EXPECT_EQ(at64.kv_grad, at256.kv_grad) << preset;
    EXPECT_GT(at256.host, at64.host) << preset;
  }
}

// StateBytesPerToken is what the cache of one more token takes, over all layers: full backprop's cache of a 64-token
// sequence (whole pages of 4) is 64 of it, on a hybrid too, whose Gated DeltaNet layers hold no pages.
TEST(OffloadMemoryTest, StateBytesPerTokenIsTheCacheOfAToken) {
  for (const std::string preset : {"tiny", "tiny-qwen3.5", "tiny-bamba"}) {
    auto model = MakeModel(*TransformerPreset(preset));
    Sequence s = RaggedBatch(model->vocab_size(), 99)[0];
    while (s.ids.size() < 64) {
      s.ids.insert(s.ids.end(), s.ids.begin(), s.ids.end());
      s.labels.insert(s.labels.end(), s.labels.begin(), s.labels.end());
    }
    s.ids.resize(64);
    s.labels.resize(64);
    StrategyOptions o = Seco(8, 4, 0, false);
    o.name = "full";
    model->memory().ResetPeak();
    FullBackprop(*model, s, 1.0, o);
    EXPECT_EQ(model->memory().Snapshot().peak[static_cast<int>(MemCategory::kKVCache)],
              64 * model->StateBytesPerToken())
        << preset;
  }
}

TEST(OffloadOptionsTest, OnlySecoOnTransformers) {
  for (const std::string strategy : {"full", "streambp", "ckpt", "spaco"}) {
    StrategyOptions o = Seco(4, 4, 0, true);
    o.name = strategy;
    const absl::Status s = ValidateStrategyOptions(o);
    EXPECT_FALSE(s.ok()) << strategy;
    EXPECT_NE(s.message().find("--offload"), std::string::npos) << s;
  }
  EXPECT_TRUE(ValidateStrategyOptions(Seco(4, 4, 0, true)).ok());

  auto ssm = CreateMamba(*MambaPreset("tiny-ssm"), DType::kF64);
  ASSERT_TRUE(ssm.ok()) << ssm.status();
  const absl::Status s = ValidateStrategyForModel(Seco(4, 4, 0, true), **ssm);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--offload"), std::string::npos) << s;
  // The strategy refuses it too when called without validation.
  EXPECT_THROW(ChunkedBackprop(**ssm, RaggedBatch((*ssm)->vocab_size(), 1)[0], 1.0, Seco(4, 4, 0, true)),
               std::invalid_argument);
}

}  // namespace
}  // namespace sg
