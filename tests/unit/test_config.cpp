// test_config.cpp — MoeConfig: every validate() rule rejects a bad value with a message naming the field
// and the value; capacity() follows ceil(cf·T·k/E) (at least 1, -1 when dropless); summary() and the
// name parsers.
//
// Run: dmoe_unit_tests --gtest_filter='Config*'
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/config.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

// A small valid configuration; each test breaks one field of it.
MoeConfig valid_config() {
  MoeConfig c;
  c.tokens = 6;
  c.hidden = 8;
  c.ffn = 16;
  c.experts = 4;
  c.top_k = 2;
  c.world = 2;
  return c;
}

// validate() must throw dmoe::Error whose message contains every one of `parts`.
void expect_rejected(const MoeConfig& c, const std::vector<std::string>& parts) {
  try {
    c.validate();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& part : parts)
      EXPECT_NE(msg.find(part), std::string::npos) << "message lacks '" << part << "': " << msg;
    return;
  }
  ADD_FAILURE() << "validate() accepted " << c.summary() << "; expected a message with '" << parts[0]
                << "'";
}

TEST(ConfigValidate, AcceptsValid) {
  EXPECT_NO_THROW(valid_config().validate());
  MoeConfig c = valid_config();
  c.capacity_factor = 1.25;
  c.dtype = DType::bf16;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  EXPECT_NO_THROW(c.validate());
  c.top_k = c.experts;  // k = E is allowed
  EXPECT_NO_THROW(c.validate());
}

TEST(ConfigValidate, RejectsSizes) {
  MoeConfig c = valid_config();
  c.tokens = 0;
  expect_rejected(c, {"tokens = 0"});
  c = valid_config();
  c.tokens = -3;
  expect_rejected(c, {"tokens = -3"});
  c = valid_config();
  c.hidden = 0;
  expect_rejected(c, {"hidden = 0"});
  c = valid_config();
  c.ffn = -1;
  expect_rejected(c, {"ffn = -1"});
  c = valid_config();
  c.experts = 0;
  expect_rejected(c, {"experts = 0"});
}

TEST(ConfigValidate, RejectsTopK) {
  MoeConfig c = valid_config();
  c.top_k = 0;
  expect_rejected(c, {"top_k = 0", "experts (4)"});
  c.top_k = 5;  // > E
  expect_rejected(c, {"top_k = 5", "experts (4)"});
}

TEST(ConfigValidate, RejectsWorld) {
  MoeConfig c = valid_config();
  c.world = 0;
  expect_rejected(c, {"world = 0"});
  c.world = 3;  // 4 experts over 3 ranks
  expect_rejected(c, {"experts = 4", "world = 3", "divisible"});
}

TEST(ConfigValidate, RejectsCapacityFactor) {
  MoeConfig c = valid_config();
  c.capacity_factor = -0.5;
  expect_rejected(c, {"capacity_factor = -0.5"});
  c.capacity_factor = std::numeric_limits<double>::quiet_NaN();
  expect_rejected(c, {"capacity_factor = nan"});
  c.capacity_factor = std::numeric_limits<double>::infinity();
  expect_rejected(c, {"capacity_factor = inf"});
}

TEST(ConfigValidate, RejectsDType) {
  MoeConfig c = valid_config();
  c.dtype = DType::f64;  // only f32 and bf16 are storage types
  expect_rejected(c, {"dtype = f64"});
  c.dtype = DType::i32;
  expect_rejected(c, {"dtype = i32"});
}

TEST(ConfigValidate, RejectsLossCoefficients) {
  MoeConfig c = valid_config();
  c.aux_loss_coef = -0.25;
  expect_rejected(c, {"aux_loss_coef = -0.25"});
  c = valid_config();
  c.aux_loss_coef = std::numeric_limits<double>::infinity();
  expect_rejected(c, {"aux_loss_coef = inf"});
  c = valid_config();
  c.z_loss_coef = -1;
  expect_rejected(c, {"z_loss_coef = -1"});
  c = valid_config();
  c.z_loss_coef = std::numeric_limits<double>::quiet_NaN();
  expect_rejected(c, {"z_loss_coef = nan"});
}

TEST(ConfigValidate, RejectsOverflowingSizes) {
  // T·W·k·max(H, I) = 2^20 · 2 · 2 · 2^31 = 2^53 >= 2^52.
  MoeConfig c = valid_config();
  c.tokens = int64_t(1) << 20;
  c.hidden = int64_t(1) << 31;
  expect_rejected(c, {"tokens*world*top_k*max(hidden, ffn)"});
  // T·W·k = 2^29 · 2 · 2 = 2^31: row indices would not fit int32 (the 2^52 rule holds with H = I = 1).
  c = valid_config();
  c.tokens = int64_t(1) << 29;
  c.hidden = 1;
  c.ffn = 1;
  expect_rejected(c, {"tokens*world*top_k = 2147483648", "int32"});
  c.tokens = (int64_t(1) << 29) - 1;
  EXPECT_NO_THROW(c.validate());
}

TEST(ConfigCapacity, Formula) {
  MoeConfig c = valid_config();
  EXPECT_TRUE(c.dropless());
  EXPECT_EQ(c.capacity(), -1);
  // ceil(cf · T · k / E) with T = 6, k = 2, E = 4: T·k/E = 3.
  c.capacity_factor = 1.0;
  EXPECT_EQ(c.capacity(), 3);
  c.capacity_factor = 1.25;  // 3.75 → 4
  EXPECT_EQ(c.capacity(), 4);
  c.capacity_factor = 2.0;
  EXPECT_EQ(c.capacity(), 6);
  c.capacity_factor = 0.5;  // 1.5 → 2
  EXPECT_EQ(c.capacity(), 2);
  c.capacity_factor = 1e-6;  // ceil gives 1; never below 1
  EXPECT_EQ(c.capacity(), 1);
  c.tokens = 5;
  c.experts = 3;
  c.world = 1;
  c.capacity_factor = 1.0;  // 10/3 → 4
  EXPECT_EQ(c.capacity(), 4);
}

TEST(ConfigCapacity, Ownership) {
  MoeConfig c = valid_config();  // E = 4 over W = 2
  EXPECT_EQ(c.experts_per_rank(), 2);
  EXPECT_EQ(c.expert_owner(0), 0);
  EXPECT_EQ(c.expert_owner(1), 0);
  EXPECT_EQ(c.expert_owner(2), 1);
  EXPECT_EQ(c.expert_owner(3), 1);
  EXPECT_EQ(c.first_expert(1), 2);
}

TEST(ConfigSummary, OneLine) {
  MoeConfig c = valid_config();
  c.dtype = DType::bf16;
  EXPECT_EQ(c.summary(), "T=6 H=8 I=16 E=4 k=2 swiglu bf16 W=2 dropless");
  c.activation = Activation::gelu;
  c.dtype = DType::f32;
  c.capacity_factor = 1.25;
  EXPECT_EQ(c.summary(), "T=6 H=8 I=16 E=4 k=2 gelu f32 W=2 cf=1.25");
}

TEST(ConfigParse, NamesAndErrors) {
  EXPECT_EQ(parse_activation("relu"), Activation::relu);
  EXPECT_EQ(parse_activation("gelu"), Activation::gelu);
  EXPECT_EQ(parse_activation("swiglu"), Activation::swiglu);
  EXPECT_EQ(parse_activation("silu"), Activation::swiglu);
  EXPECT_EQ(parse_drop_policy("latest-tokens"), DropPolicy::latest_tokens);
  EXPECT_EQ(parse_drop_policy("lowest-weight"), DropPolicy::lowest_weight);
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("float32"), DType::f32);
  for (Activation a : {Activation::relu, Activation::gelu, Activation::swiglu})
    EXPECT_EQ(parse_activation(activation_name(a)), a);
  for (DropPolicy p : {DropPolicy::latest_tokens, DropPolicy::lowest_weight})
    EXPECT_EQ(parse_drop_policy(drop_policy_name(p)), p);
  try {
    parse_activation("tanh");
    ADD_FAILURE() << "parse_activation accepted 'tanh'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'tanh'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("swiglu"), std::string::npos) << msg;
  }
  EXPECT_THROW(parse_drop_policy("random"), Error);
  EXPECT_THROW(parse_dtype("f16"), Error);
}

TEST(ConfigFlops, Formula) {
  MoeConfig c = valid_config();  // 2·m·T·k·H·I with m = 3 for SwiGLU
  EXPECT_DOUBLE_EQ(c.expert_flops(), 2.0 * 3 * 6 * 2 * 8 * 16);
  c.activation = Activation::relu;
  EXPECT_DOUBLE_EQ(c.expert_flops(), 2.0 * 2 * 6 * 2 * 8 * 16);
}

TEST(ErrorKinds, BadInputHasNoSourceLocationInternalErrorsDo) {
  MoeConfig c = valid_config();
  c.top_k = 0;
  try {
    c.validate();
    ADD_FAILURE() << "top_k = 0 accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(e.is_input());
    EXPECT_EQ(std::string(e.what()).find(".cpp:"), std::string::npos) << e.what();
  }
  try {
    DMOE_REQUIRE(false, "an invariant");
  } catch (const Error& e) {
    EXPECT_FALSE(e.is_input());
    EXPECT_NE(std::string(e.what()).find("test_config.cpp:"), std::string::npos) << e.what();
  }
  error_rank() = 3;
  try {
    DMOE_FAIL_INPUT("bad value {}", 7);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[rank 3] bad value 7");
  }
  error_rank() = -1;
}

// Sixth bad-input pass (docs/faults.md, 2026-12-03): a NUL in a quoted key or tensor name ended the printed message
// there (fprintf's %s), and other control characters reached the terminal as they were.
TEST(ErrorKinds, ControlCharactersInMessagesAreShownEscaped) {
  try {
    DMOE_FAIL_INPUT("unknown key '{}'; allowed keys: tokens", std::string("tokens\0", 7));
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "unknown key 'tokens\\u0000'; allowed keys: tokens");
  }
  try {
    DMOE_REQUIRE(false, "name '{}'\nsecond line\t{}", "\x1b[2J", "\x7f");
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("name '\\u001b[2J'\nsecond line\t\\u007f (test_config.cpp:", 0), 0u) << msg;
  }
}

}  // namespace
}  // namespace dmoe
