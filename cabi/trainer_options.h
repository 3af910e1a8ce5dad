// sg_trainer_options described once: cabi/trainer_options.inc lists its fields with their kinds and defaults, and
// this header checks at compile time that the list and the public header's struct agree (same fields, same order,
// same types). The C ABI and the bindings include it to handle every option from the list.
#ifndef SEQGRAD_CABI_TRAINER_OPTIONS_H_
#define SEQGRAD_CABI_TRAINER_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "seqgrad/seqgrad.h"

namespace sg::cabi {

enum class OptionKind { kString, kInt64, kUint64, kInt32, kBool, kDouble };

// The C type of a kind's field (kBool: an int32_t flag).
template <OptionKind K>
using OptionCType = std::conditional_t<
    K == OptionKind::kString, const char*,
    std::conditional_t<K == OptionKind::kDouble, double,
                       std::conditional_t<K == OptionKind::kInt64, int64_t,
                                          std::conditional_t<K == OptionKind::kUint64, uint64_t, int32_t>>>>;

namespace trainer_options_layout {

struct Field {
  size_t offset, size, align;
};

// The fields of the list (options and layout-only fields) in its order, where the header has them.
inline constexpr Field kFields[] = {
#define SG_TRAINER_OPTIONS_LAYOUT(name)                                  \
  {offsetof(sg_trainer_options, name), sizeof(sg_trainer_options::name), \
   alignof(std::remove_all_extents_t<decltype(sg_trainer_options::name)>)},
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_TRAINER_OPTIONS_LAYOUT(name)
#include "cabi/trainer_options.inc"
};

// Whether the list's fields follow each other without gaps and end where the struct does.
constexpr bool Contiguous() {
  size_t end = 0;
  for (const Field& f : kFields) {
    if (f.offset != (end + f.align - 1) / f.align * f.align) return false;
    end = f.offset + f.size;
  }
  return (end + alignof(sg_trainer_options) - 1) / alignof(sg_trainer_options) * alignof(sg_trainer_options) ==
         sizeof(sg_trainer_options);
}

// Initializers sg_trainer_options takes (one per scalar, an array's elements each): a field in the tail padding,
// which Contiguous cannot see, makes one more.
constexpr size_t kScalars = 0
#define SG_TRAINER_OPTIONS_LAYOUT(name) \
  +sizeof(sg_trainer_options::name) / sizeof(std::remove_all_extents_t<decltype(sg_trainer_options::name)>)
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc) SG_TRAINER_OPTIONS_LAYOUT(name)
#include "cabi/trainer_options.inc"
    ;
struct AnyValue {
  template <typename T>
  constexpr operator T() const;  // NOLINT: converts to any field type, only in unevaluated contexts
};
template <typename T, typename Indices, typename = void>
struct TakesInitializers : std::false_type {};
template <typename T, size_t... I>
struct TakesInitializers<T, std::index_sequence<I...>, std::void_t<decltype(T{(void(I), AnyValue{})...})>>
    : std::true_type {};

static_assert(Contiguous(), "cabi/trainer_options.inc does not list sg_trainer_options' fields in the header's order");
static_assert(TakesInitializers<sg_trainer_options, std::make_index_sequence<kScalars>>::value &&
                  !TakesInitializers<sg_trainer_options, std::make_index_sequence<kScalars + 1>>::value,
              "sg_trainer_options has a field that cabi/trainer_options.inc does not list");
#define SG_TRAINER_OPTION(name, kind, def, engine, cli, doc)                                       \
  static_assert(std::is_same_v<decltype(sg_trainer_options::name), OptionCType<OptionKind::kind>>, \
                "sg_trainer_options." #name " is not of the kind cabi/trainer_options.inc gives it");
#include "cabi/trainer_options.inc"

}  // namespace trainer_options_layout
}  // namespace sg::cabi

#endif  // SEQGRAD_CABI_TRAINER_OPTIONS_H_
