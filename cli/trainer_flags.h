// The tools' flags of the trainer options, from the one list of them (cabi/trainer_options.inc, its cli column):
// every option the tools expose is the flag --<option name>, with the list's help text. Tools(d) options are flags of
// every tool (cli/common.cc), Train(d) options of train only (cli/train.cc); d is the tools' default.
//
// Expand the list with SG_TRAINER_OPTION defined as SG_CLI_OPTION(WHAT, ...) to get, for each flagged option,
// SG_CLI_<WHAT>_<Tools|Train|None>(name, flag type, engine struct, tools' default, doc).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"

#define SG_CLI_Tools(d) Tools, d
#define SG_CLI_Train(d) Train, d
#define SG_CLI_NoFlag None, 0

#define SG_CLI_TYPE_kString std::string
#define SG_CLI_TYPE_kInt64 int64_t
#define SG_CLI_TYPE_kUint64 uint64_t
#define SG_CLI_TYPE_kInt32 int32_t
#define SG_CLI_TYPE_kBool bool
#define SG_CLI_TYPE_kDouble double

#define SG_CLI_OPTION(what, name, kind, engine, cli, doc) SG_CLI_OPTION_(what, name, kind, engine, doc, SG_CLI_##cli)
#define SG_CLI_OPTION_(...) SG_CLI_OPTION__(__VA_ARGS__)
#define SG_CLI_OPTION__(what, name, kind, engine, doc, where, d) \
  SG_CLI_##what##_##where(name, SG_CLI_TYPE_##kind, engine, d, doc)

#define SG_CLI_SKIP(...)

// Declarations of the flags every tool has.
#define SG_CLI_DECLARE_Tools(name, type, engine, d, doc) ABSL_DECLARE_FLAG(type, name);
#define SG_CLI_DECLARE_Train SG_CLI_SKIP
#define SG_CLI_DECLARE_None SG_CLI_SKIP
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_CLI_OPTION(DECLARE, name, kind, engine, cli, doc)
#include "cabi/trainer_options.inc"

// A flag's definition, and its copy into the engine's option struct (StrategyOptions, ...) in a function template
// over Engine with `Engine* to`: where the list gives the option to Engine as it is, to->name = --name.
#define SG_CLI_DEFINE_FLAG(name, type, engine, d, doc) ABSL_FLAG(type, name, d, doc);
#define SG_CLI_COPY_FLAG(name, type, engine, d, doc) \
  if constexpr (std::is_same_v<Engine, engine>) to->name = absl::GetFlag(FLAGS_##name);
#define SG_CLI_FLAG_None SG_CLI_SKIP
#define SG_CLI_COPY_None SG_CLI_SKIP

namespace sg::tools {
struct ByHand;  // the options the tools convert themselves
}  // namespace sg::tools
