// JSONL loaders of core/data.h: DPO pairs and GRPO groups (conversion to sequences and per-position log-probs,
// and every kind of bad input giving an error that names the file, the line and the field), plus LoadJsonl.
#include "core/data.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace sg {
namespace {

constexpr int64_t kVocab = 97;

std::string TmpDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir ? dir : "/tmp";
}

// Writes `text` to a fresh file under TEST_TMPDIR and returns its path.
std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = TmpDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::vector<int32_t> V(std::initializer_list<int32_t> v) { return v; }

// NaN-aware comparison of per-position log-prob vectors.
void ExpectSameLogprobs(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) EXPECT_TRUE(std::isnan(got[i])) << "position " << i << ": " << got[i];
    else EXPECT_EQ(got[i], want[i]) << "position " << i;
  }
}

const double N = std::nan("");

TEST(DpoJsonl, GoodFile) {
  const std::string path = WriteFile("dpo_good.jsonl",
                                     "{\"prompt\": [5, 6, 7], \"chosen\": [8, 9], \"rejected\": [10],"
                                     " \"ref_chosen_logp\": -3.5, \"ref_rejected_logp\": -1.25, \"id\": \"extra\"}\n"
                                     "\n"
                                     "  {\"prompt\": [1], \"chosen\": [2], \"rejected\": [3, 96],"
                                     " \"ref_chosen_logp\": null}\r\n");
  absl::StatusOr<std::vector<DpoPair>> pairs = LoadDpoJsonl(path, kVocab);
  ASSERT_TRUE(pairs.ok()) << pairs.status();
  ASSERT_EQ(pairs->size(), 2);
  const DpoPair& a = (*pairs)[0];
  EXPECT_EQ(a.chosen.ids, V({5, 6, 7, 8}));
  EXPECT_EQ(a.chosen.labels, V({-100, -100, 8, 9}));
  EXPECT_EQ(a.rejected.ids, V({5, 6, 7}));
  EXPECT_EQ(a.rejected.labels, V({-100, -100, 10}));
  EXPECT_EQ(a.ref_chosen_logp, -3.5);
  EXPECT_EQ(a.ref_rejected_logp, -1.25);
  EXPECT_EQ(a.chosen.objective, nullptr);

  const DpoPair& b = (*pairs)[1];  // one-token prompt; no reference log-probs (null counts as absent)
  EXPECT_EQ(b.chosen.ids, V({1}));
  EXPECT_EQ(b.chosen.labels, V({2}));
  EXPECT_EQ(b.rejected.ids, V({1, 3}));
  EXPECT_EQ(b.rejected.labels, V({3, 96}));
  EXPECT_TRUE(std::isnan(b.ref_chosen_logp));
  EXPECT_TRUE(std::isnan(b.ref_rejected_logp));
  for (const DpoPair& p : *pairs)
    for (const Sequence* s : {&p.chosen, &p.rejected}) EXPECT_TRUE(ValidateSequence(*s, kVocab, "pair").ok());
}

TEST(GrpoJsonl, GoodFile) {
  const std::string path = WriteFile(
      "grpo_good.jsonl",
      "{\"prompt\": [5, 6, 7], \"completions\": [[8, 9], [10]], \"advantages\": [1.5, -1.5],"
      " \"old_logprobs\": [[-1, -2], [-3]], \"ref_logprobs\": [[-1.5, -2.5], [-3.5]]}\n"
      "{\"prompt\": [4], \"completions\": [[0, 1, 2]], \"advantages\": [0], \"ref_logprobs\": null}\n");
  absl::StatusOr<std::vector<GrpoGroup>> groups = LoadGrpoJsonl(path, kVocab);
  ASSERT_TRUE(groups.ok()) << groups.status();
  ASSERT_EQ(groups->size(), 2);
  const std::vector<GrpoCompletion>& g = (*groups)[0].completions;
  ASSERT_EQ(g.size(), 2);
  EXPECT_EQ(g[0].seq.ids, V({5, 6, 7, 8}));
  EXPECT_EQ(g[0].seq.labels, V({-100, -100, 8, 9}));
  EXPECT_EQ(g[0].advantage, 1.5);
  // Completion token j is predicted at position len(prompt) - 1 + j.
  ExpectSameLogprobs(g[0].old_logprobs, {N, N, -1, -2});
  ExpectSameLogprobs(g[0].ref_logprobs, {N, N, -1.5, -2.5});
  EXPECT_EQ(g[1].seq.ids, V({5, 6, 7}));
  EXPECT_EQ(g[1].seq.labels, V({-100, -100, 10}));
  EXPECT_EQ(g[1].advantage, -1.5);
  ExpectSameLogprobs(g[1].old_logprobs, {N, N, -3});
  ExpectSameLogprobs(g[1].ref_logprobs, {N, N, -3.5});

  const std::vector<GrpoCompletion>& h = (*groups)[1].completions;
  ASSERT_EQ(h.size(), 1);
  EXPECT_EQ(h[0].seq.ids, V({4, 0, 1}));
  EXPECT_EQ(h[0].seq.labels, V({0, 1, 2}));
  EXPECT_EQ(h[0].advantage, 0);
  EXPECT_TRUE(h[0].old_logprobs.empty());  // absent
  EXPECT_TRUE(h[0].ref_logprobs.empty());
}

// A bad file: its text, and pieces the error must contain (besides the path and the status code).
struct BadCase {
  const char* name;
  std::string text;
  std::vector<std::string> want;
};

void ExpectError(const absl::Status& s, const std::string& path, const BadCase& c) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << s;
  const std::string msg(s.message());
  EXPECT_EQ(msg.rfind(path, 0), 0) << c.name << ": the message must start with the path: " << msg;
  for (const std::string& w : c.want)
    EXPECT_NE(msg.find(w), std::string::npos) << c.name << ": '" << w << "' not in: " << msg;
}

const char kGoodDpo[] = R"({"prompt": [1, 2], "chosen": [3], "rejected": [4], "ref_chosen_logp": -1, "ref_rejected_logp": -2})";

TEST(DpoJsonl, BadInputs) {
  const std::string good = std::string(kGoodDpo) + "\n";
  const std::vector<BadCase> cases = {
      {"malformed", good + "{\"prompt\": [1, 2], \"chosen\": [3\n", {":2: malformed JSON at column"}},
      {"trailing garbage", R"({"prompt": [1], "chosen": [3], "rejected": [4]} x)", {":1: malformed JSON"}},
      {"nan literal", R"({"prompt": [1], "chosen": [3], "rejected": [4], "ref_chosen_logp": NaN, "ref_rejected_logp": 1})",
       {":1: malformed JSON"}},
      {"overflowing number", R"({"prompt": [1], "chosen": [3], "rejected": [4], "ref_chosen_logp": -1e999, "ref_rejected_logp": 1})",
       {":1: malformed JSON", "1e999"}},
      {"not an object", good + "\n[1, 2, 3]\n", {":3: expected a JSON object, got an array"}},
      {"missing prompt", R"({"chosen": [3], "rejected": [4]})", {":1: field 'prompt' is missing"}},
      {"missing chosen", good + R"({"prompt": [1], "rejected": [4]})", {":2: field 'chosen' is missing"}},
      {"null rejected", R"({"prompt": [1], "chosen": [3], "rejected": null})", {":1: field 'rejected' is null"}},
      {"chosen mistyped", R"({"prompt": [1], "chosen": "abc", "rejected": [4]})",
       {":1: field 'chosen' must be an array of token ids, got the string \"abc\""}},
      {"float id", R"({"prompt": [1, 2.5], "chosen": [3], "rejected": [4]})",
       {":1: field 'prompt[1]' must be an integer token id, got 2.5"}},
      {"bool id", R"({"prompt": [1], "chosen": [true], "rejected": [4]})",
       {"field 'chosen[0]' must be an integer token id, got true"}},
      {"empty prompt", R"({"prompt": [], "chosen": [3], "rejected": [4]})",
       {":1: field 'prompt' is empty: the prompt needs at least one token"}},
      {"empty chosen", R"({"prompt": [1], "chosen": [], "rejected": [4]})", {"field 'chosen' is empty"}},
      {"empty rejected", R"({"prompt": [1], "chosen": [3], "rejected": []})", {"field 'rejected' is empty"}},
      {"id = vocab", R"({"prompt": [1], "chosen": [3], "rejected": [4, 97]})",
       {":1: field 'rejected[1]' is 97, outside the vocabulary [0, 97)"}},
      {"negative id", R"({"prompt": [-1], "chosen": [3], "rejected": [4]})", {"field 'prompt[0]' is -1, outside"}},
      {"huge id", R"({"prompt": [18446744073709551615], "chosen": [3], "rejected": [4]})",
       {"field 'prompt[0]' is 18446744073709551615, outside"}},
      {"only ref_chosen_logp", R"({"prompt": [1], "chosen": [3], "rejected": [4], "ref_chosen_logp": -1})",
       {":1: field 'ref_rejected_logp' is missing while 'ref_chosen_logp' is given"}},
      {"only ref_rejected_logp", R"({"prompt": [1], "chosen": [3], "rejected": [4], "ref_rejected_logp": -1})",
       {":1: field 'ref_chosen_logp' is missing while 'ref_rejected_logp' is given"}},
      {"ref mistyped", R"({"prompt": [1], "chosen": [3], "rejected": [4], "ref_chosen_logp": "-1", "ref_rejected_logp": -2})",
       {":1: field 'ref_chosen_logp' must be a number, got the string \"-1\""}},
      {"ref array", R"({"prompt": [1], "chosen": [3], "rejected": [4], "ref_chosen_logp": -1, "ref_rejected_logp": [-2]})",
       {"field 'ref_rejected_logp' must be a number, got an array"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = WriteFile("dpo_bad_" + std::to_string(i) + ".jsonl", cases[i].text);
    ExpectError(LoadDpoJsonl(path, 97).status(), path, cases[i]);
  }
}

TEST(GrpoJsonl, BadInputs) {
  const std::string g2 = R"("prompt": [1, 2], "completions": [[3, 4], [5]])";
  const std::vector<BadCase> cases = {
      {"malformed", "\n\n{\"prompt\": [1, 2], \"completions\": [[3, 4], [5]], }\n", {":3: malformed JSON at column"}},
      {"not an object", "\"text\"", {":1: expected a JSON object, got the string \"text\""}},
      {"missing prompt", R"({"completions": [[3]], "advantages": [1]})", {":1: field 'prompt' is missing"}},
      {"empty prompt", R"({"prompt": [], "completions": [[3]], "advantages": [1]})", {"field 'prompt' is empty"}},
      {"missing completions", R"({"prompt": [1], "advantages": [1]})", {":1: field 'completions' is missing"}},
      {"completions mistyped", R"({"prompt": [1], "completions": {"a": 1}, "advantages": [1]})",
       {"field 'completions' must be an array, got an object"}},
      {"G = 0", R"({"prompt": [1], "completions": [], "advantages": []})",
       {":1: field 'completions' is empty: a group needs at least one completion (G >= 1)"}},
      {"empty completion", "{" + g2.substr(0, g2.size() - 5) + "[]], \"advantages\": [1, 2]}",
       {"field 'completions[1]' is empty: a completion needs at least one token"}},
      {"completion not an array", R"({"prompt": [1], "completions": [3], "advantages": [1]})",
       {"field 'completions[0]' must be an array of token ids, got 3"}},
      {"completion id out of vocab", R"({"prompt": [1], "completions": [[3], [4, 100]], "advantages": [1, 2]})",
       {"field 'completions[1][1]' is 100, outside the vocabulary [0, 97)"}},
      {"missing advantages", "{" + g2 + "}", {":1: field 'advantages' is missing"}},
      {"advantages count", "{" + g2 + R"(, "advantages": [1, 2, 3]})",
       {":1: field 'advantages' has 3 entries for G = 2 completions"}},
      {"advantage mistyped", "{" + g2 + R"(, "advantages": [1, null]})",
       {"field 'advantages[1]' must be a number, got null"}},
      {"advantage overflow", "{" + g2 + R"(, "advantages": [1, 1e400]})", {":1: malformed JSON"}},
      {"old_logprobs count", "{" + g2 + R"(, "advantages": [1, -1], "old_logprobs": [[-1, -2]]})",
       {":1: field 'old_logprobs' has 1 entries for G = 2 completions"}},
      {"old_logprobs mistyped", "{" + g2 + R"(, "advantages": [1, -1], "old_logprobs": -1})",
       {"field 'old_logprobs' must be an array, got -1"}},
      {"old_logprobs length", "{" + g2 + R"(, "advantages": [1, -1], "old_logprobs": [[-1, -2], [-1, -2]]})",
       {":1: field 'old_logprobs[1]' has 2 entries for the 1 tokens of completions[1]"}},
      {"ref_logprobs count", "{" + g2 + R"(, "advantages": [1, -1], "ref_logprobs": [[-1, -2], [-1], [-1]]})",
       {"field 'ref_logprobs' has 3 entries for G = 2 completions"}},
      {"ref_logprobs length", "{" + g2 + R"(, "advantages": [1, -1], "ref_logprobs": [[-1], [-1]]})",
       {"field 'ref_logprobs[0]' has 1 entries for the 2 tokens of completions[0]"}},
      {"ref_logprobs value", "{" + g2 + R"(, "advantages": [1, -1], "ref_logprobs": [[-1, "x"], [-1]]})",
       {"field 'ref_logprobs[0][1]' must be a number, got the string \"x\""}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = WriteFile("grpo_bad_" + std::to_string(i) + ".jsonl", cases[i].text);
    ExpectError(LoadGrpoJsonl(path, 97).status(), path, cases[i]);
  }
}

TEST(ObjectiveJsonl, EmptyAndMissingFiles) {
  for (const std::string text : {"", "\n  \n\t\r\n"}) {
    const std::string path = WriteFile("empty.jsonl", text);
    absl::Status d = LoadDpoJsonl(path, kVocab).status();
    EXPECT_EQ(d.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(d.message()), path + ": no DPO pairs (the file has no non-blank lines)");
    absl::Status g = LoadGrpoJsonl(path, kVocab).status();
    EXPECT_EQ(g.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(g.message()), path + ": no GRPO groups (the file has no non-blank lines)");
  }
  const std::string missing = TmpDir() + "/no/such.jsonl";
  EXPECT_EQ(LoadDpoJsonl(missing, kVocab).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadGrpoJsonl(missing, kVocab).status().code(), absl::StatusCode::kNotFound);
  absl::Status d = LoadDpoJsonl(TmpDir(), kVocab).status();
  EXPECT_EQ(d.code(), absl::StatusCode::kInvalidArgument) << d;
  EXPECT_NE(d.message().find("is a directory"), absl::string_view::npos) << d;
  EXPECT_EQ(LoadDpoJsonl(WriteFile("v.jsonl", std::string(kGoodDpo)), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Jsonl, GoodAndBad) {
  const std::string path = WriteFile("sft.jsonl", "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n");
  absl::StatusOr<std::vector<Sequence>> seqs = LoadJsonl(path, 16, kVocab);
  ASSERT_TRUE(seqs.ok()) << seqs.status();
  ASSERT_EQ(seqs->size(), 1);
  EXPECT_EQ((*seqs)[0].ids, V({1, 2}));
  EXPECT_EQ((*seqs)[0].labels, V({2, 3}));
  const std::string bad = WriteFile("sft_bad.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1, 2\n");
  absl::Status s = LoadJsonl(bad, 16, kVocab).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(bad + ":2: malformed JSON"), absl::string_view::npos) << s;
}

// A record longer than seq_len + 1 tokens is refused by default, naming the file, the line and both lengths (and how
// many records are that long); truncation and splitting are asked for, and counted.
TEST(Jsonl, OverlongRecordsAreRefusedUnlessTruncatedOrSplit) {
  std::string ten = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]";
  const std::string path = WriteFile(
      "overlong.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": " + ten + "}\n{\"input_ids\": " + ten +
                            ", \"labels\": [-100, -100, -100, -100, -100, 6, 7, 8, 9, 10]}\n");
  absl::Status s = LoadJsonl(path, 4, kVocab).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(path + ":2: field 'input_ids' has 10 tokens (9 positions to train), more than "
                                    "--seq_len=4; 2 of 3 records are longer"),
            absl::string_view::npos)
      << s;

  JsonlCounts counts;
  absl::StatusOr<std::vector<Sequence>> truncated = LoadJsonl(path, 4, kVocab, kDefaultMaxLineBytes,
                                                              Overlong::kTruncate, &counts);
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  // Line 3 keeps 5 tokens whose labels are all -100: dropped.
  ASSERT_EQ(truncated->size(), 2);
  EXPECT_EQ((*truncated)[1].ids, V({1, 2, 3, 4}));
  EXPECT_EQ((*truncated)[1].labels, V({2, 3, 4, 5}));
  EXPECT_EQ(counts.Summary(), "3 records -> 2 sequences; 2 truncated (10 tokens cut); 1 cut piece without labels dropped");

  absl::StatusOr<std::vector<Sequence>> split = LoadJsonl(path, 4, kVocab, kDefaultMaxLineBytes, Overlong::kSplit,
                                                          &counts);
  ASSERT_TRUE(split.ok()) << split.status();
  // Line 2 in windows of 5 tokens overlapping by one: every label once. Line 3 loses its first (unlabelled) window.
  ASSERT_EQ(split->size(), 6);
  EXPECT_EQ((*split)[1].ids, V({1, 2, 3, 4}));
  EXPECT_EQ((*split)[2].ids, V({5, 6, 7, 8}));
  EXPECT_EQ((*split)[3].ids, V({9}));
  EXPECT_EQ((*split)[3].labels, V({10}));
  EXPECT_EQ((*split)[4].labels, V({6, 7, 8, 9}));
  EXPECT_EQ((*split)[5].labels, V({10}));
  EXPECT_EQ(counts.Summary(), "3 records -> 6 sequences; 2 split; 1 cut piece without labels dropped");
  // 10 tokens train 9 positions: whole at --seq_len=9.
  ASSERT_TRUE(LoadJsonl(path, 9, kVocab, kDefaultMaxLineBytes, Overlong::kRefuse, &counts).ok());
  EXPECT_EQ(counts.Summary(), "3 records");
  EXPECT_EQ(ParseOverlong("cut").status().code(), absl::StatusCode::kInvalidArgument);
}

// Documents of a record from "position_ids" (Hugging Face's flattening convention) and/or "doc_lengths": the same
// doc_starts either way, the label crossing each start masked, and split pieces keep the documents they cut.
TEST(Jsonl, DocumentsFromPositionIdsOrLengths) {
  const std::string ids = "\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]";
  const std::string positions = "\"position_ids\": [0, 1, 2, 0, 1, 0, 1, 2]";
  const std::string lengths = "\"doc_lengths\": [3, 2, 3]";
  const std::string path = WriteFile("docs.jsonl", "{" + ids + ", " + positions + "}\n{" + ids + ", " + lengths +
                                                       "}\n{" + ids + ", " + positions + ", " + lengths + "}\n");
  absl::StatusOr<std::vector<Sequence>> seqs = LoadJsonl(path, 16, kVocab);
  ASSERT_TRUE(seqs.ok()) << seqs.status();
  ASSERT_EQ(seqs->size(), 3);
  for (const Sequence& s : *seqs) {
    EXPECT_EQ(s.doc_starts, (std::vector<int64_t>{0, 3, 5}));
    EXPECT_EQ(s.labels, V({2, 3, -100, 5, -100, 7, 8}));
  }
  // Windows of 4 tokens overlapping by one: [1 2 3 4] [4 5 6 7] [7 8].
  absl::StatusOr<std::vector<Sequence>> split = LoadJsonl(WriteFile("docs1.jsonl", "{" + ids + ", " + lengths + "}\n"),
                                                          3, kVocab, kDefaultMaxLineBytes, Overlong::kSplit);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_EQ(split->size(), 3);
  EXPECT_EQ((*split)[0].doc_starts, (std::vector<int64_t>{0}));  // the second document's first token: only a label
  EXPECT_EQ((*split)[0].labels, V({2, 3, -100}));
  EXPECT_EQ((*split)[1].ids, V({4, 5, 6}));
  EXPECT_EQ((*split)[1].doc_starts, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ((*split)[1].labels, V({5, -100, 7}));
  EXPECT_TRUE((*split)[2].doc_starts.empty());  // [7 8]: inside one document
}

TEST(Jsonl, BadDocumentsNameTheLineAndField) {
  const std::string ids = "{\"input_ids\": [1, 2, 3, 4], ";
  const struct {
    std::string line, error;
  } cases[] = {
      {ids + "\"position_ids\": [1, 2, 3, 4]}", "field 'position_ids[0]' is 1; positions start at 0"},
      {ids + "\"position_ids\": [0, 1, 3, 4]}", "field 'position_ids[2]' is 3; positions start at 0 and each is the "
                                                "previous + 1 (2) or 0"},
      {ids + "\"position_ids\": [0, 1, 2]}", "field 'position_ids' has 3 entries for 4 input ids"},
      {ids + "\"position_ids\": [0, 1, -1, 0]}", "field 'position_ids[2]' is -1"},
      {ids + "\"doc_lengths\": [2, 0, 2]}", "field 'doc_lengths[1]' is 0; document lengths are >= 1"},
      {ids + "\"doc_lengths\": [2, 3]}", "field 'doc_lengths[1]' is 3"},
      {ids + "\"doc_lengths\": [2, 1]}", "field 'doc_lengths' sums to 3, not the 4 input ids"},
      {ids + "\"doc_lengths\": 4}", "field 'doc_lengths' must be an array"},
      {ids + "\"doc_lengths\": [2, 2], \"position_ids\": [0, 1, 2, 0]}",
       "field 'doc_lengths' starts documents at 0,2 and 'position_ids' at 0,3"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) {
    const std::string path = WriteFile("bad_docs" + std::to_string(i) + ".jsonl", "{\"input_ids\": [1, 2]}\n" +
                                                                                      cases[i].line + "\n");
    absl::Status s = LoadJsonl(path, 16, kVocab).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << cases[i].line;
    EXPECT_NE(s.message().find(path + ":2: " + cases[i].error), absl::string_view::npos) << s;
  }
}

// --doc_sep_token: a document ends after each separator, windows keep the documents they cut.
TEST(TokenBin, SeparatorEndsDocuments) {
  std::string bytes;
  for (uint16_t t : {5, 6, 0, 7, 8, 9, 0, 4, 3}) bytes += std::string{static_cast<char>(t), '\0'};
  const std::string path = WriteFile("sep.bin", bytes);
  absl::StatusOr<std::vector<Sequence>> seqs = LoadTokenBin(path, 2, 8, kVocab, /*doc_sep_token=*/0);
  ASSERT_TRUE(seqs.ok()) << seqs.status();
  ASSERT_EQ(seqs->size(), 1);
  EXPECT_EQ((*seqs)[0].doc_starts, (std::vector<int64_t>{0, 3, 7}));
  EXPECT_EQ((*seqs)[0].labels, V({6, 0, -100, 8, 9, 0, -100, 3}));
  seqs = LoadTokenBin(path, 2, 4, kVocab, 0);  // windows [5 6 0 7 8] [8 9 0 4 3]
  ASSERT_TRUE(seqs.ok()) << seqs.status();
  ASSERT_EQ(seqs->size(), 2);
  EXPECT_EQ((*seqs)[0].doc_starts, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ((*seqs)[1].doc_starts, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ((*seqs)[1].labels, V({9, 0, -100, 3}));
  seqs = LoadTokenBin(path, 2, 8, kVocab);  // no separator: one stream
  ASSERT_TRUE(seqs.ok());
  EXPECT_TRUE((*seqs)[0].doc_starts.empty());
  absl::Status s = LoadTokenBin(path, 2, 8, kVocab, kVocab).status();
  EXPECT_NE(s.message().find("--doc_sep_token=97 is outside the vocabulary"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace sg
