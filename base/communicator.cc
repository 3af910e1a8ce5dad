#include "base/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace sg::dist {

namespace {
std::string Serialize(const std::map<std::string, std::string>& config) {
  std::string out;
  for (const auto& [k, v] : config) absl::StrAppend(&out, k, "=", v, "\n");
  return out;
}
std::map<std::string, std::string> Parse(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
    pos = end + 1;
  }
  return out;
}
}  // namespace

uint64_t ConfigHash(const std::map<std::string, std::string>& config) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : Serialize(config)) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

absl::Status CheckSameConfig(Communicator& comm, const std::map<std::string, std::string>& config) {
  const int n = comm.size();
  const int64_t mine = static_cast<int64_t>(ConfigHash(config));
  std::vector<int64_t> all(n);
  if (absl::Status s = comm.AllGather(&mine, all.data(), 1, DType::kI64); !s.ok())
    return absl::Status(s.code(), absl::StrCat("configuration check: ", s.message()));
  if (std::all_of(all.begin(), all.end(), [&](int64_t h) { return h == all[0]; })) return absl::OkStatus();
  // Mismatch (every rank sees it): rank 0 broadcasts its configuration so that each rank can name its fields.
  std::string text = comm.rank() == 0 ? Serialize(config) : std::string();
  int64_t len = static_cast<int64_t>(text.size());
  if (absl::Status s = comm.Broadcast(&len, 1, DType::kI64, 0); !s.ok()) return s;
  std::vector<int32_t> buf((len + 3) / 4);
  if (comm.rank() == 0) std::copy(text.begin(), text.end(), reinterpret_cast<char*>(buf.data()));
  if (absl::Status s = comm.Broadcast(buf.data(), static_cast<int64_t>(buf.size()), DType::kI32, 0); !s.ok()) return s;
  const std::map<std::string, std::string> root = Parse(std::string(reinterpret_cast<const char*>(buf.data()), len));
  std::string msg = absl::StrCat(
      "configuration differs across ranks (model and strategy options must be the same on "
      "every rank); config hash per rank:");
  for (int r = 0; r < n; ++r) absl::StrAppend(&msg, " ", r, ":", absl::Hex(static_cast<uint64_t>(all[r])));
  if (all[comm.rank()] != all[0]) {
    absl::StrAppend(&msg, "; rank ", comm.rank(), " against rank 0:");
    std::map<std::string, std::string> keys = root;
    keys.insert(config.begin(), config.end());
    for (const auto& [k, unused] : keys) {
      auto a = config.find(k), b = root.find(k);
      const std::string here = a == config.end() ? "(absent)" : absl::StrCat("'", a->second, "'");
      const std::string there = b == root.end() ? "(absent)" : absl::StrCat("'", b->second, "'");
      if (here != there) absl::StrAppend(&msg, "\n  ", k, ": rank ", comm.rank(), " ", here, ", rank 0 ", there);
    }
  } else {
    absl::StrAppend(&msg, " (this rank, ", comm.rank(), ", agrees with rank 0; the differing ranks list the fields)");
  }
  return absl::FailedPreconditionError(msg);
}

absl::StatusOr<int> FirstFailedRank(Communicator& comm, bool failed) {
  std::vector<int64_t> first = {failed ? comm.rank() : comm.size()};
  if (absl::Status s = comm.AllReduce(first, ReduceOp::kMin); !s.ok()) return s;
  return static_cast<int>(first[0]);
}

absl::Status AgreeAcrossRanks(Communicator& comm, const absl::Status& local) {
  absl::StatusOr<int> failed = FirstFailedRank(comm, !local.ok());
  if (!failed.ok()) return failed.status();
  if (!local.ok()) return local;
  if (*failed == comm.size()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("rank ", *failed, " of ", comm.size(), " failed (its status says why)"));
}

absl::Status WriteOnRankZero(Communicator& comm, const std::function<absl::Status()>& write) {
  absl::Status mine = comm.rank() == 0 ? write() : absl::OkStatus();
  // Rank 0's code and message, as int32s (the element types a communicator carries).
  std::vector<int32_t> head = {static_cast<int32_t>(mine.code()), static_cast<int32_t>(mine.message().size())};
  if (absl::Status s = comm.Broadcast(head.data(), 2, DType::kI32, 0); !s.ok()) return s;
  std::vector<int32_t> text(head[1]);
  for (size_t i = 0; i < text.size() && comm.rank() == 0; ++i) text[i] = static_cast<unsigned char>(mine.message()[i]);
  if (head[1] > 0)
    if (absl::Status s = comm.Broadcast(text.data(), head[1], DType::kI32, 0); !s.ok()) return s;
  if (comm.rank() == 0 || head[0] == 0) return mine;
  std::string message = "rank 0: ";
  for (int32_t c : text) message.push_back(static_cast<char>(c));
  return absl::Status(static_cast<absl::StatusCode>(head[0]), message);
}

absl::StatusOr<double> TimeoutSeconds(double default_s) {
  const char* env = std::getenv("SEQGRAD_DIST_TIMEOUT_S");
  if (!env || !*env) return default_s;
  char* end = nullptr;
  const double timeout = std::strtod(env, &end);
  if (end == env || *end)
    return absl::InvalidArgumentError(absl::StrCat("SEQGRAD_DIST_TIMEOUT_S='", env, "' is not a number"));
  return timeout;
}

}  // namespace sg::dist
