// Where the dmoe tool finds its named configs (tools/dmoe/data_dir.hpp): $DMOE_HOME, then the install's
// share/dmoe beside the running executable, then the source tree it was built from. Tested on a copy of
// the binary in a made-up install prefix, run from an unrelated working directory, with names that exist
// only in one of the places.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cli_test_util.hpp"
#include "model/config_io.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

using test::run_shell;

void write_text(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

std::string config_json(int hidden) {
  return R"({"tokens": 4, "hidden": )" + std::to_string(hidden) + R"(, "ffn": 8, "experts": 4, "top_k": 2})";
}

class DataDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_data_dir_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_ / "prefix/bin");
    fs::create_directories(dir_ / "elsewhere");
    // A copy, not a link: /proc/self/exe names the file itself, so a link would lead back to the build.
    fs::copy_file(DMOE_CLI_PATH, exe(), fs::copy_options::overwrite_existing);
    write_text(dir_ / "prefix/share/dmoe/bench/configs/only-installed.json", config_json(16));
    write_text(dir_ / "home/bench/configs/only-installed.json", config_json(24));
    fs::create_directories(dir_ / "prefix/share/dmoe/bench/flow");
    fs::copy_file(fs::path(DMOE_SOURCE_DIR) / "bench/flow/example.json",
                  dir_ / "prefix/share/dmoe/bench/flow/installed-costs.json");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string exe() const { return (dir_ / "prefix/bin/dmoe").string(); }
  // The installed copy, run from dir_/elsewhere; `home` empty: DMOE_HOME unset.
  test::CliResult run(const std::string& args, const std::string& home = "") const {
    const std::string env = home.empty() ? "env -u DMOE_HOME" : "env DMOE_HOME=" + home;
    return run_shell("cd " + (dir_ / "elsewhere").string() + " && " + env + " " + exe() + " " + args);
  }
  // The hidden size of the config that `init --config NAME` resolved.
  int64_t resolved_hidden(const std::string& name, const std::string& home = "") const {
    const auto r = run("init --config " + name + " --out w.safetensors --save-config c.json", home);
    EXPECT_EQ(r.status, 0) << r.output;
    return r.status == 0 ? load_config_file((dir_ / "elsewhere/c.json").string()).hidden : -1;
  }
  fs::path dir_;
};

TEST_F(DataDir, InstalledCopyFindsTheDataBesideItFromAnyDirectory) {
  EXPECT_EQ(resolved_hidden("only-installed"), 16);
  const auto r = run("flow simulate --costs installed-costs --schedule vanilla");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find((dir_ / "prefix/share/dmoe/bench/flow/installed-costs.json").string()), std::string::npos)
      << r.output;
}

TEST_F(DataDir, DmoeHomeComesFirstThenTheInstallThenTheSourceTree) {
  EXPECT_EQ(resolved_hidden("only-installed", (dir_ / "home").string()), 24);  // $DMOE_HOME over the install
  EXPECT_EQ(resolved_hidden("cpu-small", (dir_ / "home").string()), 256);      // only the source tree has it
  // A file path is taken as it is, whatever the search path has.
  write_text(dir_ / "elsewhere/only-installed", config_json(40));
  EXPECT_EQ(resolved_hidden("only-installed", (dir_ / "home").string()), 40);
}

TEST_F(DataDir, ANameFoundNowhereListsEveryPlaceInSearchOrder) {
  const auto r = run("init --config no-such-config --out w.safetensors", (dir_ / "home").string());
  EXPECT_NE(r.status, 0);
  const std::string& out = r.output;
  const size_t home = out.find((dir_ / "home/bench/configs/no-such-config.json").string() + " ($DMOE_HOME");
  const size_t installed =
      out.find((dir_ / "prefix/share/dmoe/bench/configs/no-such-config.json").string() + " (the install's data folder");
  const size_t source = out.find("bench/configs/no-such-config.json (the source tree dmoe was built from");
  EXPECT_NE(home, std::string::npos) << out;
  EXPECT_NE(installed, std::string::npos) << out;
  EXPECT_NE(source, std::string::npos) << out;
  EXPECT_LT(home, installed) << out;
  EXPECT_LT(installed, source) << out;
  EXPECT_NE(out.find("is neither a file nor a named config"), std::string::npos) << out;
  // The names on offer, from all places together.
  EXPECT_NE(out.find("cpu-small"), std::string::npos) << out;
  EXPECT_NE(out.find("only-installed"), std::string::npos) << out;
  EXPECT_EQ(out.find(".cpp:"), std::string::npos) << "bad input, no source location: " << out;
  EXPECT_FALSE(fs::exists(dir_ / "elsewhere/w.safetensors"));
}

TEST_F(DataDir, BadDmoeHomeAndMissingPathsAreClearErrors) {
  auto r = run("init --config cpu-small --out w.safetensors", (dir_ / "no-such-dir").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("DMOE_HOME='" + (dir_ / "no-such-dir").string() + "' is not a directory"), std::string::npos)
      << r.output;
  // A folder without bench/ (seventh bad-input pass): passed over without a word, cpu-small came from the install.
  fs::create_directories(dir_ / "no-bench");
  r = run("init --config cpu-small --out w.safetensors", (dir_ / "no-bench").string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("DMOE_HOME='" + (dir_ / "no-bench").string() + "' has no bench/ folder"), std::string::npos)
      << r.output;
  // A path is not looked up among the named configs (the source tree has bench/configs/cpu-small.json).
  r = run("init --config configs/cpu-small.json --out w.safetensors");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("config file 'configs/cpu-small.json': cannot be opened for reading"), std::string::npos)
      << r.output;
  // A missing data folder beside the executable is said so.
  fs::remove_all(dir_ / "prefix/share");
  r = run("init-model --config no-such-model --out m.safetensors");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("(the install's data folder, beside " + exe() + ": no such folder)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("named model configs there: "), std::string::npos) << r.output;
}

// F16, F19 (fifteenth pass): a named file that is a device, FIFO or directory was "not there"; a model's name given
// where a layer config is read did not say it is a model; DMOE_HOME set to the source tree listed that folder twice.
TEST_F(DataDir, ANameOfTheOtherKindOrNoRegularFileIsSaid) {
  fs::create_directories(dir_ / "home/bench/models");
  fs::create_symlink("/dev/zero", dir_ / "home/bench/models/zero.json");
  fs::create_directories(dir_ / "home/bench/models/folder.json");
  auto r = run("init-model --config zero --out m.safetensors", (dir_ / "home").string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("models/zero.json ($DMOE_HOME: there, but a device, not a regular file)"), std::string::npos)
      << r.output;
  r = run("init-model --config folder --out m.safetensors", (dir_ / "home").string());
  EXPECT_NE(r.output.find("($DMOE_HOME: there, but a directory, not a regular file)"), std::string::npos) << r.output;
  r = run("init --config tiny --out w.safetensors", DMOE_SOURCE_DIR);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("'tiny' is a named model config ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("which init-model, train, eval"), std::string::npos) << r.output;
  const std::string source = (fs::path(DMOE_SOURCE_DIR) / "bench/configs/tiny.json").string() + " (";
  const size_t first = r.output.find(source);
  ASSERT_NE(first, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(source, first + 1), std::string::npos) << "one folder listed twice:\n" << r.output;
  EXPECT_NE(r.output.find("($DMOE_HOME; also the source tree dmoe was built from: not there)"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace dmoe
