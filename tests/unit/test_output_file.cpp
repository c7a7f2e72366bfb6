// test_output_file.cpp — write_file_atomically and the output checks (core/output_file.hpp): a failed
// write leaves the old file untouched and no temporary behind; only regular files are replaced; file
// identity (hard links, symlinks, "./x") is what decides "same file".
//
// Run: dmoe_unit_tests --gtest_filter='OutputFile*'.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "error_test_util.hpp"
#include "core/output_file.hpp"
#include "file_flag_test_util.hpp"
#include "kill_test_util.hpp"

namespace dmoe {
namespace {

using test::error_of;

namespace fs = std::filesystem;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class OutputFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_outfile_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const char* name) const { return (dir_ / name).string(); }
  size_t entries() const { return size_t(std::distance(fs::directory_iterator(dir_), fs::directory_iterator())); }
  // In a child process: a, b, c.txt committed as "new" with the journal .commit.json, killed (SIGKILL) right after the
  // first rename. The parent checks that it died by the signal.
  void commit_killed_after_first_rename() const {
    const int status = test::run_child_signalled_after_rename(0, SIGKILL, [&] {
      OutputFileSet set;
      for (const char* name : {"a.txt", "b.txt", "c.txt"}) set.write(p(name), std::string_view("new"));
      set.commit(p(".commit.json"));
    });
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  }
  // As above, with a new run's log.txt (its temporary holding "new 1\nnew 2\n", an earlier log.txt at the target)
  // published by the commit as its last rename; killed (SIGKILL) right after rename `kill_after` (0..2: the set's,
  // 3: the log's).
  void commit_with_log_killed_after(size_t kill_after) const {
    const int status = test::run_child_signalled_after_rename(kill_after, SIGKILL, [&] {
      GrowingOutputFile log(p("log.txt"), "--log", /*append=*/false);
      log.write("new 1\n");
      log.write("new 2\n");
      OutputFileSet set;
      for (const char* name : {"a.txt", "b.txt", "c.txt"}) set.write(p(name), std::string_view("new"));
      set.commit(p(".commit.json"), &log);
    });
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  }
  // The terminating signal `sig` (not ignored here), in a child: raised while a set's temporaries and a new log's
  // temporary exist, it leaves every target as it was and no temporary, and ends the process; sent during a commit,
  // it is held back until the last rename, then ends the process.
  void expect_cleaned_up_and_held_back(int sig) const {
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const struct rlimit no_core {0, 0};
      ::setrlimit(RLIMIT_CORE, &no_core);  // SIGQUIT and SIGXCPU dump a core by default
      OutputFileSet set;
      set.write(p("a.txt"), std::string_view("new a"));
      set.write(p("d.txt"), std::string_view("new d"));  // both temporaries exist, neither is renamed yet
      GrowingOutputFile log(p("c.txt"), "--log", /*append=*/false);
      log.write("a line\n");  // replaces an earlier c.txt: the piece waits in its temporary
      ::raise(sig);
      ::_exit(3);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "signal " << sig << ": status " << status;
    EXPECT_EQ(read_text(p("a.txt")), "old");
    EXPECT_EQ(read_text(p("c.txt")), "old");
    EXPECT_FALSE(fs::exists(p("d.txt")));
    EXPECT_EQ(temporaries(), std::vector<std::string>{}) << "signal " << sig;

    // During a commit: held back until the last rename, then the process ends by it.
    const int held = test::run_child_signalled_after_rename(0, sig, [&] {
      const struct rlimit no_core {0, 0};
      ::setrlimit(RLIMIT_CORE, &no_core);
      OutputFileSet set;
      for (const char* name : {"a.txt", "b.txt", "c.txt"}) set.write(p(name), std::string_view("new"));
      set.commit();
    });
    EXPECT_TRUE(WIFSIGNALED(held) && WTERMSIG(held) == sig) << "signal " << sig << ": status " << held;
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name << ", " << sig;
    EXPECT_EQ(entries(), 3u) << "signal " << sig << ": a temporary was left";
  }
  // The names in the directory that are dmoe temporaries.
  std::vector<std::string> temporaries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename().string().find(".dmoe-tmp.") != std::string::npos)
        names.push_back(e.path().filename().string());
    return names;
  }
  fs::path dir_;
};

TEST_F(OutputFile, WritesNewAndReplacesRegularFileKeepingItsMode) {
  write_file_atomically(p("a.txt"), std::string_view("first"));
  EXPECT_EQ(read_text(p("a.txt")), "first");
  ::chmod(p("a.txt").c_str(), 0640);
  write_file_atomically(p("a.txt"), std::string_view("second, longer"));
  EXPECT_EQ(read_text(p("a.txt")), "second, longer");
  struct stat st {};
  ASSERT_EQ(::stat(p("a.txt").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_EQ(entries(), 1u);  // no temporary left
}

TEST_F(OutputFile, FailedWriteLeavesOldFileAndNoTemporary) {
  write_file_atomically(p("a.txt"), std::string_view("old content"));
  // A file-size limit makes write() fail with EFBIG part-way (SIGXFSZ ignored), as a full disk would.
  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  struct rlimit small = old_limit;
  small.rlim_cur = 1000;
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string msg = error_of([&] { write_file_atomically(p("a.txt"), std::string(5000, 'x')); });
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find("a.txt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unchanged"), std::string::npos) << msg;
  EXPECT_EQ(read_text(p("a.txt")), "old content");
  EXPECT_EQ(entries(), 1u);
}

TEST_F(OutputFile, RefusesDevicesDirectoriesFifosAndProc) {
  for (const char* path : {"/dev/full", "/dev/null"}) {
    if (!fs::exists(path)) continue;
    const std::string msg = error_of([&] { write_file_atomically(path, std::string_view("x")); });
    EXPECT_NE(msg.find("character device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("regular files"), std::string::npos) << msg;
    EXPECT_TRUE(fs::is_character_file(path));
    EXPECT_NE(error_of([&] { check_output_file(path, "--json"); }).find("--json"), std::string::npos);
  }
  EXPECT_NE(error_of([&] { write_file_atomically(dir_.string(), std::string_view("x")); }).find("a directory"),
            std::string::npos);
  ASSERT_EQ(::mkfifo(p("fifo").c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { check_output_file(p("fifo"), "--output"); }).find("FIFO"), std::string::npos);
  EXPECT_TRUE(fs::is_fifo(p("fifo")));
  // A regular file where no temporary can be created (even as root).
  if (fs::exists("/proc/version"))
    EXPECT_NE(error_of([&] { check_output_file("/proc/version", "--json"); }).find("cannot create a temporary"),
              std::string::npos);
  EXPECT_NE(error_of([&] { check_output_file(p("no-dir/x.json"), "--json"); }).find("does not exist"),
            std::string::npos);
  EXPECT_EQ(entries(), 1u);  // the FIFO only
}

// Seventh bad-input pass: a SIGTERM or SIGINT during a write (a scheduler ending the job, Ctrl-C) left the hidden
// temporaries ".NAME.dmoe-tmp.PID.N" behind. The process still ends by the signal, the targets unchanged.
TEST_F(OutputFile, TemporariesAreRemovedWhenASignalEndsTheProcess) {
  for (const int sig : {SIGTERM, SIGINT}) {
    struct sigaction now {};
    ASSERT_EQ(::sigaction(sig, nullptr, &now), 0);
    if (now.sa_handler == SIG_IGN) GTEST_SKIP() << "signal " << sig << " is ignored in this process (and so in children)";
    write_file_atomically(p("a.txt"), std::string_view("old"));
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      OutputFileSet set;
      set.write(p("a.txt"), std::string_view("new a"));
      set.write(p("b.txt"), std::string_view("new b"));  // both temporaries exist, neither is renamed yet
      ::raise(sig);
      ::_exit(3);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_EQ(read_text(p("a.txt")), "old");
    EXPECT_FALSE(fs::exists(p("b.txt")));
    std::string names;
    for (const auto& e : fs::directory_iterator(dir_)) names += e.path().filename().string() + " ";
    EXPECT_EQ(entries(), 1u) << "signal " << sig << " left: " << names;
  }
}

// G1, G2 (sixteenth pass): a SIGTERM between two renames of a set left a checkpoint of mixed steps (and a sharded
// model of two seeds). A signal during the commit now waits for the last rename; the process then ends by it.
TEST_F(OutputFile, ASignalDuringACommitWaitsForItsLastRename) {
  for (const int sig : {SIGTERM, SIGINT}) {
    struct sigaction now {};
    ASSERT_EQ(::sigaction(sig, nullptr, &now), 0);
    if (now.sa_handler == SIG_IGN) GTEST_SKIP() << "signal " << sig << " is ignored in this process (and so in children)";
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
    // The signal after the first of three renames, held back until the commit is done, then ending the child.
    const int status = test::run_child_signalled_after_rename(0, sig, [&] {
      OutputFileSet set;
      for (const char* name : {"a.txt", "b.txt", "c.txt"}) set.write(p(name), std::string_view("new"));
      set.commit();
    });
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
    EXPECT_EQ(entries(), 3u) << "a temporary was left";
  }
}

// G19-4 (nineteenth pass): the files a commit replaces for good (a replaced index's old shards) were removed after
// it, so a signal held back during its renames ended the process first and left them. They go before the signal now;
// a set that is not committed removes none.
TEST_F(OutputFile, FilesRemovedWithACommitGoBeforeItsHeldSignal) {
  struct sigaction now {};
  ASSERT_EQ(::sigaction(SIGTERM, nullptr, &now), 0);
  if (now.sa_handler == SIG_IGN) GTEST_SKIP() << "SIGTERM is ignored in this process (and so in children)";
  for (const char* name : {"a.txt", "old1.txt", "old2.txt"}) write_file_atomically(p(name), std::string_view("old"));
  const int status = test::run_child_signalled_after_rename(1, SIGTERM, [&] {
    OutputFileSet set;
    for (const char* name : {"a.txt", "b.txt"}) set.write(p(name), std::string_view("new"));
    for (const char* name : {"old1.txt", "old2.txt"}) set.remove_after_commit(p(name));
    set.commit();
  });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;
  for (const char* name : {"a.txt", "b.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_FALSE(fs::exists(p("old1.txt")));
  EXPECT_FALSE(fs::exists(p("old2.txt")));
  EXPECT_EQ(entries(), 2u) << "a temporary was left";
  // Not committed (destroyed, or a write failed): every file stays.
  write_file_atomically(p("old1.txt"), std::string_view("old"));
  {
    OutputFileSet set;
    set.write(p("a.txt"), std::string_view("newer"));
    set.remove_after_commit(p("old1.txt"));
  }
  EXPECT_EQ(read_text(p("a.txt")), "new");
  EXPECT_EQ(read_text(p("old1.txt")), "old");
  EXPECT_EQ(entries(), 3u);
}

// G20-6 (twentieth pass): only SIGINT, SIGTERM and SIGHUP removed the temporaries and were held back during a commit.
// A CPU-time limit (SIGXCPU), Slurm's --signal or `timeout -s USR1` (SIGUSR1), an alarm or a closed output pipe left
// the hidden temporaries behind (a run's whole log), and could end a commit between two renames.
TEST_F(OutputFile, EveryTerminatingSignalFromOutsideRemovesTemporariesAndWaitsForACommit) {
  for (const int sig : {SIGUSR1, SIGUSR2, SIGXCPU, SIGALRM, SIGVTALRM, SIGPROF, SIGQUIT, SIGPIPE}) {
    struct sigaction now {};
    ASSERT_EQ(::sigaction(sig, nullptr, &now), 0);
    if (now.sa_handler == SIG_IGN) continue;  // ignored in this process (and so in children): nothing to test
    expect_cleaned_up_and_held_back(sig);
  }
  // A signal the user set to be ignored (nohup, `trap '' USR1`) stays ignored: no handler ends the process by it.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGUSR1, SIG_IGN);
    OutputFileSet set;
    set.write(p("e.txt"), std::string_view("e"));
    ::raise(SIGUSR1);
    set.commit();
    ::_exit(3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "status " << status;
  EXPECT_EQ(read_text(p("e.txt")), "e");
}

// G1 (sixteenth pass) under SIGKILL, which cannot be held back: a set committed with a journal and killed after its
// first of three renames is completed by finish_interrupted_commit (all three new, no temporary or journal left).
TEST_F(OutputFile, ACommitKilledBetweenRenamesIsCompletedFromItsJournal) {
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
  const std::string journal = p(".commit.json");
  EXPECT_EQ(finish_interrupted_commit(journal), "") << "no journal: nothing to do";
  ASSERT_NO_FATAL_FAILURE(commit_killed_after_first_rename());
  // The mix the kill left: the first file new, the others old, their temporaries and the journal beside them.
  EXPECT_EQ(read_text(p("a.txt")), "new");
  EXPECT_EQ(read_text(p("b.txt")), "old");
  EXPECT_TRUE(fs::exists(journal));
  const std::string completed = finish_interrupted_commit(journal);
  EXPECT_NE(completed.find("b.txt"), std::string::npos) << completed;
  EXPECT_NE(completed.find("c.txt"), std::string::npos) << completed;
  EXPECT_EQ(completed.find("a.txt"), std::string::npos) << completed;
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_EQ(entries(), 3u) << "a temporary or the journal was left";

  // A commit that ends normally leaves no journal.
  {
    OutputFileSet set;
    set.write(p("a.txt"), std::string_view("newer"));
    set.commit(journal);
  }
  EXPECT_FALSE(fs::exists(journal));
  EXPECT_EQ(read_text(p("a.txt")), "newer");

  // A journal dmoe did not write, or one that would move a file that is no dmoe temporary or onto a file outside its
  // directory, is refused; nothing moves (H2, H7 of the seventeenth pass: "../victim.txt" was replaced; a
  // "dmoe_commit" of another type ended in an internal JSON error).
  write_file_atomically(journal, std::string_view("not json"));
  EXPECT_NE(error_of([&] { finish_interrupted_commit(journal); }).find("is not one dmoe wrote"), std::string::npos);
  write_file_atomically(journal, std::string_view(R"({"dmoe_commit": "1", "renames": []})"));
  EXPECT_NE(error_of([&] { finish_interrupted_commit(journal); }).find("is not one dmoe wrote"), std::string::npos);
  for (const char* entry : {R"({"temporary": "b.txt", "target": "a.txt", "temporary_id": "1:1", "replaced_id": "none"})",
                            R"({"temporary": ".a.txt.dmoe-tmp.1.1", "target": "../a.txt", "temporary_id": "1:1", "replaced_id": "none"})",
                            R"({"temporary": ".a.txt.dmoe-tmp.1.1", "target": "/tmp/a.txt", "temporary_id": "1:1", "replaced_id": "none"})"}) {
    write_file_atomically(journal, std::string(R"({"dmoe_commit": 1, "renames": [)") + entry + "]}");
    EXPECT_NE(error_of([&] { finish_interrupted_commit(journal); }).find("dmoe's journals name a '.NAME.dmoe-tmp.PID.N' "
                                                                        "temporary and a file of their own directory only"),
              std::string::npos) << entry;
  }
  write_file_atomically(journal, std::string_view(R"({"dmoe_commit": 1, "renames": [{"temporary": "b.txt", "target": "a.txt"}]})"));
  EXPECT_NE(error_of([&] { finish_interrupted_commit(journal); }).find("has an entry without"), std::string::npos);
  EXPECT_EQ(read_text(p("a.txt")), "newer");
  EXPECT_EQ(read_text(p("b.txt")), "new");
  fs::remove(journal);
}

// G20-1 (twentieth pass): a rename that failed part-way through a set (a bind-mounted optimizer.safetensors: EBUSY)
// left the files renamed before it replaced and the rest not, the journal removed: a checkpoint of two saves that every
// resume refused. The files already replaced are now put back from backups made before the first rename. Here the
// third rename fails because its target became a directory after the checks (EISDIR).
std::string g_sabotaged;  // the target the hook below turns into a non-empty directory
TEST_F(OutputFile, ARenameThatFailsPartWayPutsTheReplacedFilesBack) {
  for (const bool journaled : {false, true}) {
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
    fs::remove_all(p("d.txt"));
    g_sabotaged = p("c.txt");
    set_after_rename_hook_for_tests([](size_t renamed) {
      if (renamed != 2) return;  // after a.txt, d.txt (new) and b.txt: c.txt's rename fails
      fs::remove(g_sabotaged);
      fs::create_directories(g_sabotaged + "/inside");
    });
    const std::string e = error_of([&] {
      OutputFileSet set;
      for (const char* name : {"a.txt", "d.txt", "b.txt", "c.txt"}) set.write(p(name), std::string_view("new"));
      set.commit(journaled ? p(".commit.json") : std::string());
    });
    set_after_rename_hook_for_tests(nullptr);
    // G22B-7 (d): d.txt was new; it was said to have been "replaced and put back".
    EXPECT_NE(e.find("writing '" + p("c.txt") + "' failed at the rename of its temporary onto it: Is a directory; it "
                     "is unchanged, and so are the other files written with it: '" + p("a.txt") + "', '" + p("b.txt") +
                     "' had been replaced and were put back as they were, and '" + p("d.txt") + "', new, was created "
                     "and removed again"), std::string::npos)
        << e;
    EXPECT_EQ(read_text(p("a.txt")), "old");
    EXPECT_EQ(read_text(p("b.txt")), "old");
    EXPECT_FALSE(fs::exists(p("d.txt"))) << "a file the set created is removed again";
    std::string names;
    for (const auto& entry : fs::directory_iterator(dir_)) names += entry.path().filename().string() + " ";
    EXPECT_EQ(entries(), 3u) << "a temporary, a backup or the journal was left: " << names;
    fs::remove_all(p("c.txt"));
  }
  // A commit that succeeds leaves no backup either (entries() above and in the other tests), and its journal named
  // them: a commit killed between its renames is completed with its backups removed (ACommitKilledBetweenRenames...).
}

// G20-1: a target that is a mount point (a bind-mounted file) cannot be renamed over (EBUSY); it is refused by
// check_output_file before the work, and by the commit before any rename where it became one since. Needs a mount.
TEST_F(OutputFile, AMountPointTargetIsRefusedBeforeAnythingIsReplaced) {
  for (const char* name : {"a.txt", "b.txt", "src.txt"}) write_file_atomically(p(name), std::string_view("old"));
  if (::mount(p("src.txt").c_str(), p("b.txt").c_str(), nullptr, MS_BIND, nullptr) != 0)
    GTEST_SKIP() << "cannot bind-mount a file here (" << std::strerror(errno) << ")";
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{p("b.txt")};
  std::string e = error_of([&] { check_output_file(p("b.txt"), "--log"); });
  EXPECT_NE(e.find("--log '" + p("b.txt") + "' is a mount point (a file mounted over that name: a bind mount, or a "
                   "container's volume such as `-v FILE:FILE`), which rename(2) cannot replace"), std::string::npos)
      << e;
  fs::create_symlink(p("b.txt"), p("link.txt"));
  e = error_of([&] { check_output_file(p("link.txt"), "--json"); });
  EXPECT_NE(e.find("(its target '" + p("b.txt") + "') is a mount point"), std::string::npos) << e;
  EXPECT_EQ(error_of([&] { check_output_file(p("a.txt"), "--json"); }), "(no error)");
  e = error_of([&] {
    OutputFileSet set;
    for (const char* name : {"a.txt", "b.txt"}) set.write(p(name), std::string_view("new"));
    set.commit(p(".commit.json"));
  });
  EXPECT_NE(e.find("is a mount point"), std::string::npos) << e;
  EXPECT_NE(e.find("nothing was replaced (nor any other file written with it)"), std::string::npos) << e;
  EXPECT_EQ(read_text(p("a.txt")), "old");
  EXPECT_EQ(read_text(p("b.txt")), "old");
  EXPECT_EQ(entries(), 4u) << "a temporary or the journal was left";
}

// G20-1: another user's file in a sticky directory (/tmp, shared scratch) cannot be renamed over by this user (EPERM):
// refused before the work. Needs root, to make a file of one user and run the check as another (nobody).
TEST_F(OutputFile, AnotherUsersFileInAStickyDirectoryIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: a file of another user, checked as nobody";
  fs::create_directories(dir_ / "shared");
  ::chmod(dir_.c_str(), 0755);
  ::chmod(p("shared").c_str(), 01777);
  write_file_atomically(p("shared/theirs.json"), std::string_view("{}"));  // root's, writable by everyone
  ::chmod(p("shared/theirs.json").c_str(), 0666);
  // As root (CAP_FOWNER) the rename is allowed: no error.
  EXPECT_EQ(error_of([&] { check_output_file(p("shared/theirs.json"), "--json"); }), "(no error)");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0 || ::access(p("shared").c_str(), W_OK | X_OK) != 0) ::_exit(5);
    const std::string e = error_of([&] { check_output_file(p("shared/theirs.json"), "--json"); });
    const bool named = e.find("--json '" + p("shared/theirs.json") + "' belongs to another user (uid 0) in '" +
                              p("shared") + "', a directory with the sticky bit (mode 1777, as /tmp)") !=
                       std::string::npos;
    // A new name beside it is fine, and so is the user's own file there.
    const bool own_ok = error_of([&] { write_file_atomically(p("shared/mine.json"), std::string_view("{}")); }) ==
                            "(no error)" &&
                        error_of([&] { check_output_file(p("shared/mine.json"), "--json"); }) == "(no error)";
    ::_exit(named && own_ok ? 0 : (named ? 7 : 6));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 5)
    GTEST_SKIP() << "cannot become nobody here, or nobody cannot reach " << dir_ << " (TMPDIR's permissions)";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << " (6: the sticky directory was not named, 7: the user's own file was refused)";
  EXPECT_EQ(read_text(p("shared/theirs.json")), "{}");
}

// H1 (seventeenth pass): after a kill between renames, files restored by hand (`cp backup/* ck/` skips the hidden
// journal) were overwritten on the next resume by the killed save's stale temporaries, and the journal removed. A
// journal now records the identity of each temporary and of the file it replaces; where a file has changed since,
// nothing is completed and the error says so.
TEST_F(OutputFile, AJournalIsNotCompletedOverFilesChangedSinceTheKill) {
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
  ASSERT_NO_FATAL_FAILURE(commit_killed_after_first_rename());
  write_file_atomically(p("b.txt"), std::string_view("restored"));  // a new file at b.txt: not the one replaced
  const std::string e = error_of([&] { finish_interrupted_commit(p(".commit.json")); });
  EXPECT_NE(e.find("b.txt' has changed since (it is not the file the save was replacing)"), std::string::npos) << e;
  EXPECT_EQ(read_text(p("b.txt")), "restored");
  EXPECT_EQ(read_text(p("c.txt")), "old");
  EXPECT_TRUE(fs::exists(p(".commit.json"))) << "the journal is kept: the user decides";
}

// H6 (seventeenth pass): a new run's log was published after its first checkpoint's commit, so a SIGKILL between the
// two (or between the commit's renames) left, on resume, the checkpoint completed beside the earlier run's log, the new
// lines in an orphaned temporary. The log's rename is now the commit's last and in its journal: completed with the
// others where the resuming command's own --log is that file.
TEST_F(OutputFile, ALogPublishedWithACommitIsCompletedFromItsJournal) {
  const std::string journal = p(".commit.json");
  const auto start_over = [&] {
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
    write_file_atomically(p("log.txt"), std::string_view("earlier run\n"));
  };
  start_over();
  // Committed whole: the log is published, and its later pieces go on into the file under its name.
  {
    GrowingOutputFile log(p("log.txt"), "--log", /*append=*/false);
    log.write("new 1\n");
    EXPECT_FALSE(log.published());
    OutputFileSet set;
    set.write(p("a.txt"), std::string_view("new"));
    set.commit(journal, &log);
    EXPECT_TRUE(log.published());
    log.write("new 2\n");
    log.close();
  }
  EXPECT_EQ(read_text(p("log.txt")), "new 1\nnew 2\n");
  EXPECT_EQ(read_text(p("a.txt")), "new");
  EXPECT_FALSE(fs::exists(journal));
  EXPECT_EQ(temporaries(), std::vector<std::string>{});

  // Killed after the set's three renames, before the log's: the journal holds the log's rename too.
  start_over();
  ASSERT_NO_FATAL_FAILURE(commit_with_log_killed_after(2));
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_EQ(read_text(p("log.txt")), "earlier run\n");
  ASSERT_TRUE(fs::exists(journal));
  EXPECT_NE(read_text(journal).find("\"option\": \"--log\""), std::string::npos) << read_text(journal);
  std::string left = "unset";
  const std::string completed = finish_interrupted_commit(journal, {{"--log", p("log.txt")}}, &left);
  EXPECT_NE(completed.find("log.txt"), std::string::npos) << completed;
  EXPECT_EQ(left, "");
  EXPECT_EQ(read_text(p("log.txt")), "new 1\nnew 2\n");
  EXPECT_FALSE(fs::exists(journal));
  EXPECT_EQ(temporaries(), std::vector<std::string>{});

  // Killed between the set's renames; the resuming command names the log through a symbolic link (the same file).
  start_over();
  ASSERT_NO_FATAL_FAILURE(commit_with_log_killed_after(0));
  EXPECT_EQ(read_text(p("b.txt")), "old");
  fs::create_symlink(p("log.txt"), p("link.txt"));
  const std::string both = finish_interrupted_commit(journal, {{"--log", p("link.txt")}});
  for (const char* name : {"b.txt", "c.txt", "log.txt"}) EXPECT_NE(both.find(name), std::string::npos) << both;
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_EQ(read_text(p("log.txt")), "new 1\nnew 2\n");
  EXPECT_TRUE(fs::is_symlink(p("link.txt")));
  EXPECT_FALSE(fs::exists(journal));
  EXPECT_EQ(temporaries(), std::vector<std::string>{});

  // A command without --log completes the set and leaves the log's temporary, saying where its lines are.
  fs::remove(p("link.txt"));
  start_over();
  ASSERT_NO_FATAL_FAILURE(commit_with_log_killed_after(0));
  const std::string set_only = finish_interrupted_commit(journal, {}, &left);
  EXPECT_EQ(set_only.find("log.txt"), std::string::npos) << set_only;
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_EQ(read_text(p("log.txt")), "earlier run\n");
  ASSERT_EQ(temporaries().size(), 1u);
  EXPECT_EQ(left, "'" + p(temporaries()[0].c_str()) + "' (the new content of --log '" + p("log.txt") + "'; mv '" +
                      p(temporaries()[0].c_str()) + "' '" + p("log.txt") + "' puts it in place)");
  EXPECT_EQ(read_text(p(temporaries()[0].c_str())), "new 1\nnew 2\n");
  EXPECT_FALSE(fs::exists(journal));
}

// H6's completion keeps H1's and H2's rules: the log's entry is outside the journal's directory, so it is completed
// only onto the resuming command's own --log, the file the save was replacing, unchanged since; otherwise nothing at
// all is renamed and the journal is kept.
TEST_F(OutputFile, AJournaledLogIsCompletedOnlyOntoTheSameUnchangedFile) {
  const std::string journal = p(".commit.json");
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
  write_file_atomically(p("log.txt"), std::string_view("earlier run\n"));
  write_file_atomically(p("other.txt"), std::string_view("another log\n"));
  ASSERT_NO_FATAL_FAILURE(commit_with_log_killed_after(0));
  const auto nothing_moved = [&](const std::string& log_content, const char* what) {
    EXPECT_EQ(read_text(p("a.txt")), "new") << what;
    for (const char* name : {"b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "old") << what << ": " << name;
    EXPECT_EQ(read_text(p("log.txt")), log_content) << what;
    EXPECT_EQ(read_text(p("other.txt")), "another log\n") << what;
    EXPECT_EQ(temporaries().size(), 3u) << what;  // b's, c's and the log's
    EXPECT_TRUE(fs::exists(journal)) << what << ": the journal is kept: the user decides";
  };

  // Another file as --log (a new name for the resumed run's log): refused, saying which file the save was publishing.
  std::string e = error_of([&] { finish_interrupted_commit(journal, {{"--log", p("other.txt")}}); });
  EXPECT_NE(e.find("records a save killed before it put its --log '" + p("log.txt") + "' in place, but this "
                   "command's --log '" + p("other.txt") + "' is another file: give --log '" + p("log.txt") + "' to "
                   "complete the save with it, or leave --log out to complete the save's other files alone (its "
                   "content stays in '"), std::string::npos) << e;
  nothing_moved("earlier run\n", "another --log");
  e = error_of([&] { finish_interrupted_commit(journal, {{"--log", p("new.txt")}}); });
  EXPECT_NE(e.find("is another file"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(p("new.txt")));

  // A journal edited so that the log's temporary is a file of another directory (of dmoe's pattern, its identity
  // right): the temporary is looked for beside the command's --log only, so that file is never moved.
  const std::string edited_from = read_text(journal);
  nlohmann::json record = nlohmann::json::parse(edited_from);
  fs::create_directories(dir_ / "elsewhere");
  const std::string planted = (dir_ / "elsewhere" / ".log.txt.dmoe-tmp.1.1").string();
  write_file_atomically(planted, std::string_view("planted\n"));
  struct stat ps {};
  ASSERT_EQ(::lstat(planted.c_str(), &ps), 0);
  record["option_renames"][0]["temporary"] = planted;
  record["option_renames"][0]["temporary_id"] = std::to_string(ps.st_dev) + ":" + std::to_string(ps.st_ino);
  write_file_atomically(journal, record.dump());
  e = error_of([&] { finish_interrupted_commit(journal, {{"--log", p("log.txt")}}); });
  // (G22A-6: "neither the save's new file nor its temporary is there" said so also where a file is there.)
  EXPECT_NE(e.find("has changed since (its temporary is gone and the file there is not the save's new one)"),
            std::string::npos) << e;
  EXPECT_EQ(read_text(planted), "planted\n");
  nothing_moved("earlier run\n", "a temporary of another directory");
  // ... and one that is no dmoe temporary of the log's name: refused as it stands.
  for (const char* temporary : {"victim.txt", ".other.txt.dmoe-tmp.1.1", ".log.txt.1.1"}) {
    record["option_renames"][0]["temporary"] = p(temporary);
    write_file_atomically(journal, record.dump());
    e = error_of([&] { finish_interrupted_commit(journal, {{"--log", p("log.txt")}}); });
    EXPECT_NE(e.find("dmoe's journals name a '.NAME.dmoe-tmp.PID.N' temporary of that file's own name"),
              std::string::npos) << temporary << ": " << e;
  }
  write_file_atomically(journal, edited_from);
  nothing_moved("earlier run\n", "journals edited");

  // The log replaced since the kill (restored by hand, or another run's): H1's rule, nothing renamed.
  write_file_atomically(p("log.txt"), std::string_view("restored\n"));
  e = error_of([&] { finish_interrupted_commit(journal, {{"--log", p("log.txt")}}); });
  EXPECT_NE(e.find("records a save killed before it put its --log '" + p("log.txt") + "' in place, but that file has "
                   "changed since (it is not the file the save was replacing)"), std::string::npos) << e;
  EXPECT_NE(e.find("leave --log out to complete the save's other files alone; its content stays in '"),
            std::string::npos) << e;
  EXPECT_NE(e.find("or, to use the files as they are, remove '" + journal + "'"), std::string::npos) << e;
  nothing_moved("restored\n", "a log changed since");
}

// G3 (sixteenth pass): `--log /dev/stdout >> hist.txt` replaced hist.txt with the log (rc 0).
TEST_F(OutputFile, TheFileStandardOutputIsRedirectedToIsRefused) {
  write_file_atomically(p("hist.txt"), std::string_view("earlier lines\n"));
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(p("hist.txt").c_str(), O_WRONLY | O_APPEND);
    if (fd < 0 || ::dup2(fd, 1) < 0) ::_exit(4);
    int code = 0;
    for (const std::string& path : {std::string("/dev/stdout"), p("hist.txt")}) {
      try {
        check_output_file(path, "--log");
        code = 5;  // accepted
      } catch (const Error& e) {
        if (std::string(e.what()).find("is the file this process's standard output is redirected to") ==
            std::string::npos)
          code = 6;
      }
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(read_text(p("hist.txt")), "earlier lines\n");
}

TEST_F(OutputFile, SymlinkTargetIsReplacedAndDanglingLinkRefused) {
  write_file_atomically(p("target.txt"), std::string_view("old"));
  fs::create_symlink(p("target.txt"), p("link.txt"));
  write_file_atomically(p("link.txt"), std::string_view("new"));
  EXPECT_TRUE(fs::is_symlink(p("link.txt")));
  EXPECT_EQ(read_text(p("target.txt")), "new");
  fs::create_symlink(p("nowhere.txt"), p("dangling.txt"));
  EXPECT_NE(error_of([&] { check_output_file(p("dangling.txt"), "--output"); }).find("symbolic link"),
            std::string::npos);
}

// Sixth bad-input pass (docs/faults.md, 2026-12-03): each case failed before its fix.
TEST_F(OutputFile, PipesBehindLinksLongNamesAndFilesInThePathAreNamed) {
  // /dev/stdout into a pipe (here: a pipe's /proc/self/fd link) was "a symbolic link whose target cannot be
  // resolved (No such file or directory)".
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string link = "/proc/self/fd/" + std::to_string(fds[1]);
  std::string msg = error_of([&] { check_output_file(link, "--output"); });
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_NE(msg.find("is a symbolic link to a FIFO (named pipe) ('pipe:["), std::string::npos) << msg;
  EXPECT_NE(msg.find("standard output into a pipe"), std::string::npos) << msg;
  EXPECT_NE(msg.find("give a file path"), std::string::npos) << msg;
  // A name of 242 or 255 bytes is valid; the temporary ".NAME.dmoe-tmp.PID.N" was not ("File name too long").
  for (const size_t length : {size_t(242), size_t(255)}) {
    const std::string name = std::string(length - 3, 'y') + ".st";
    check_output_file((dir_ / name).string(), "--output");
    write_file_atomically((dir_ / name).string(), std::string_view("long"));
    EXPECT_EQ(read_text(dir_ / name), "long");
    fs::remove(dir_ / name);
  }
  EXPECT_EQ(entries(), 0u);  // no temporary left
  // Under a path part that is a file: "cannot inspect it: Not a directory" before.
  write_file_atomically(p("a.txt"), std::string_view("text"));
  msg = error_of([&] { check_output_file(p("a.txt/sub/y.st"), "--output"); });
  EXPECT_NE(msg.find("'" + p("a.txt") + "' is a regular file, not a directory"), std::string::npos) << msg;
  EXPECT_EQ(read_text(p("a.txt")), "text");
}

TEST_F(OutputFile, SameFileByIdentity) {
  write_file_atomically(p("x.bin"), std::string_view("x"));
  fs::create_hard_link(p("x.bin"), p("hard.bin"));
  fs::create_symlink(p("x.bin"), p("soft.bin"));
  EXPECT_TRUE(same_file(p("x.bin"), p("hard.bin")));
  EXPECT_TRUE(same_file(p("x.bin"), p("soft.bin")));
  EXPECT_TRUE(same_file(p("x.bin"), (dir_ / "." / "x.bin").string()));
  EXPECT_TRUE(same_file(p("new.bin"), (dir_ / "." / "new.bin").string()));  // neither exists yet
  EXPECT_FALSE(same_file(p("x.bin"), p("new.bin")));
  const std::string msg =
      error_of([&] { require_distinct_files({{"--output", p("hard.bin")}}, {{"--input", p("x.bin")}}); });
  EXPECT_NE(msg.find("--output"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--input"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] {
              require_distinct_files({{"--out", p("a")}, {"--input", (dir_ / "." / "a").string()}}, {});
            }).find("same file"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { require_distinct_files({{"--output", p("y.bin")}}, {{"--input", p("x.bin")}, {"--grad-output", ""}}); }),
            "(no error)");
}


// G20-2 (twentieth pass): two new outputs were compared by their lexically normalised paths, so "lnk/../o.json" (lnk a
// link to other/dir) was "./o.json": `flow simulate --json lnk/../o.json --trace other/o.json` wrote both into one file
// (rc 0), and `--json lnk/../q.json --trace ./q.json`, two files, was refused as one. The directory is now resolved as
// the kernel resolves it (lnk/.. is other/).
TEST_F(OutputFile, NewFilesThroughALinkAndDotDotAreComparedWhereTheKernelPutsThem) {
  fs::create_directories(dir_ / "other" / "dir");
  fs::create_symlink(dir_ / "other" / "dir", dir_ / "lnk");
  EXPECT_TRUE(same_file(p("lnk/../o.json"), p("other/o.json")));
  EXPECT_TRUE(same_file(p("other/o.json"), p("lnk/../o.json")));
  EXPECT_FALSE(same_file(p("lnk/../q.json"), p("q.json")));
  EXPECT_FALSE(same_file(p("lnk/../q.json"), p("./q.json")));
  EXPECT_TRUE(same_file(p("lnk/x.json"), p("other/dir/x.json")));
  EXPECT_TRUE(same_file(p("other/"), p("lnk/..")));  // both exist: by identity, as before
  // A directory part missing: the existing part resolved (lnk/.. is other/), the rest compared as written.
  EXPECT_TRUE(same_file(p("lnk/../new/o.json"), p("other/new/o.json")));
  EXPECT_FALSE(same_file(p("lnk/../new/o.json"), p("new/o.json")));
  const std::string msg = error_of([&] {
    require_distinct_files({{"--json", p("lnk/../o.json")}, {"--trace", p("other/o.json")}}, {});
  });
  EXPECT_NE(msg.find("are the same file"), std::string::npos) << msg;
  EXPECT_EQ(error_of([&] { require_distinct_files({{"--json", p("lnk/../q.json")}, {"--trace", p("q.json")}}, {}); }),
            "(no error)");
  // Relative paths, from inside the directory (split as given: "o.json" is in ".").
  const fs::path cwd = fs::current_path();
  fs::current_path(dir_);
  const bool relative_same = same_file("lnk/../o.json", "other/o.json");
  const bool relative_other = same_file("lnk/../o.json", "o.json");
  fs::current_path(cwd);
  EXPECT_TRUE(relative_same);
  EXPECT_FALSE(relative_other);
}

// ---- twenty-first pass ----

// G21-1: a path that is not UTF-8 made nlohmann's dump throw type_error 316 after all the work. path_for_json gives a
// string that dumps, and path_from_json the exact bytes back; a UTF-8 path is left as it is.
TEST_F(OutputFile, PathsThatAreNotUtf8GoIntoJsonAndComeBackExactly) {
  for (const std::string path : {std::string("/tmp/d\xff.txt"), std::string("caf\xc3\xa9/x"), std::string("a%b\xc3"),
                                 std::string("dmoe-bytes:%41"), std::string("\xed\xa0\x80"), std::string("\xc0\xaf"),
                                 std::string("line\nbreak\xfe"), std::string()}) {
    const std::string text = path_for_json(path);
    std::string dumped;
    EXPECT_NO_THROW(dumped = nlohmann::json(text).dump()) << path;
    EXPECT_EQ(path_from_json(nlohmann::json::parse(dumped).get<std::string>()), path);
    EXPECT_EQ(is_utf8(path) && path.rfind("dmoe-bytes:", 0) != 0, text == path) << path;  // the marker is escaped
  }
  EXPECT_EQ(path_for_json("caf\xc3\xa9/x"), "caf\xc3\xa9/x");
  EXPECT_EQ(path_for_json("/tmp/d\xff.txt"), "dmoe-bytes:/tmp/d%FF.txt");
}

// The commit journal names its files and a --log by such paths: a journaled commit with a log whose name is not UTF-8
// was refused by the dump; now it is written, and a commit killed between its renames is completed from it.
TEST_F(OutputFile, AJournalNamingFilesThatAreNotUtf8IsWrittenAndCompleted) {
  const std::string log_path = p("l\xff.txt");
  for (const char* name : {"a\xff.txt", "b.txt"}) write_file_atomically(p(name), std::string_view("old"));
  write_file_atomically(log_path, std::string_view("earlier run\n"));
  const int status = test::run_child_signalled_after_rename(0, SIGKILL, [&] {
    GrowingOutputFile log(log_path, "--log", /*append=*/false);
    log.write("new 1\n");
    OutputFileSet set;
    for (const char* name : {"a\xff.txt", "b.txt"}) set.write(p(name), std::string_view("new"));
    set.commit(p(".commit.json"), &log);
  });
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  ASSERT_TRUE(fs::exists(p(".commit.json")));
  EXPECT_NE(read_text(p(".commit.json")).find("dmoe-bytes:"), std::string::npos) << read_text(p(".commit.json"));
  const std::string completed = finish_interrupted_commit(p(".commit.json"), {{"--log", log_path}});
  EXPECT_NE(completed.find("b.txt"), std::string::npos) << completed;
  for (const char* name : {"a\xff.txt", "b.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_EQ(read_text(log_path), "new 1\n");
  EXPECT_FALSE(fs::exists(p(".commit.json")));
  EXPECT_EQ(temporaries(), std::vector<std::string>{});
}

// G21-6: SIGSTKFLT and SIGIO (`kill -STKFLT`, `kill -IO` during `train --log`) ended the process by their default
// action with the log's temporary left behind; SIGPWR and the real-time signals terminate by default too. Each now
// removes the temporaries, is held back during a commit, and still ends the process.
TEST_F(OutputFile, TheRemainingTerminatingSignalsRemoveTemporariesToo) {
  for (const int sig : {SIGSTKFLT, SIGIO, SIGPWR, SIGRTMIN, SIGRTMIN + 3, SIGRTMAX}) {
    struct sigaction now {};
    ASSERT_EQ(::sigaction(sig, nullptr, &now), 0);
    if (now.sa_handler == SIG_IGN) continue;  // ignored here (and so in children): nothing to test
    expect_cleaned_up_and_held_back(sig);
  }
}

// Sets or clears the immutable attribute of `path` (chattr +i / -i); false where the file system or user may not.
bool set_immutable(const std::string& path, bool on) { return test::set_file_flag(path, FS_IMMUTABLE_FL, on); }
std::string g_immutable_after_rename;  // the file the hook below makes immutable, so that its rename fails (EPERM)

// G21-9: a commit whose backup of one file could not be linked, and whose later rename failed, said "no backup could
// be linked" (only one had failed), and the resume that completed it said "(the process killed)". The error names the
// file without a backup and why; the journal records the failure, which finish_interrupted_commit returns for the note.
TEST_F(OutputFile, ACommitThatCouldNotBeUndoneSaysWhichBackupFailedAndItsJournalWhy) {
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) write_file_atomically(p(name), std::string_view("old"));
  if (!set_immutable(p("c.txt"), true))
    GTEST_SKIP() << "cannot set the immutable attribute here (needs root and a file system with attributes)";
  set_immutable(p("c.txt"), false);
  g_immutable_after_rename = p("c.txt");
  set_backup_link_failure_for_tests([](const std::string& target) { return target.find("/a.txt") != std::string::npos; });
  set_after_rename_hook_for_tests([](size_t renamed) {
    if (renamed == 1) set_immutable(g_immutable_after_rename, true);  // after a.txt and b.txt: c.txt's rename fails
  });
  const std::string e = error_of([&] {
    OutputFileSet set;
    for (const char* name : {"a.txt", "b.txt", "c.txt"}) set.write(p(name), std::string_view("new"));
    set.commit(p(".commit.json"));
  });
  set_after_rename_hook_for_tests(nullptr);
  set_backup_link_failure_for_tests(nullptr);
  set_immutable(p("c.txt"), false);
  EXPECT_NE(e.find("no backup of '" + p("a.txt") + "' (Operation not permitted) could be linked"), std::string::npos)
      << e;
  EXPECT_EQ(e.find("no backup could be linked"), std::string::npos) << e;
  ASSERT_TRUE(fs::exists(p(".commit.json"))) << e;
  std::string failure = "unset";
  const std::string completed = finish_interrupted_commit(p(".commit.json"), {}, nullptr, &failure);
  EXPECT_NE(completed.find("c.txt"), std::string::npos) << completed;
  EXPECT_EQ(failure, "the rename of '" + p("c.txt") + "' failed: Operation not permitted");
  for (const char* name : {"a.txt", "b.txt", "c.txt"}) EXPECT_EQ(read_text(p(name)), "new") << name;
  EXPECT_FALSE(fs::exists(p(".commit.json")));
  // A commit killed between its renames records no failure.
  ASSERT_NO_FATAL_FAILURE(commit_killed_after_first_rename());
  (void)finish_interrupted_commit(p(".commit.json"), {}, nullptr, &failure);
  EXPECT_EQ(failure, "");
}

// The log's lock (ExclusiveLock::lock_transient_file): held by one holder at a time (two opens of the file conflict
// even in one process), removed by its holder when released and when a terminating signal ends it, taken over when a
// SIGKILLed holder left it (empty); a file with content, a link or a directory at its name is refused, kept as it is
// (G23A-2: a user's file there was taken for a stale lock and removed); a file this call made and could not hold is
// not left behind (G23A-9).
TEST_F(OutputFile, ATransientLockFileIsHeldByOneAndRemovedByItsHolder) {
  using Outcome = ExclusiveLock::Outcome;
  const std::string lock = p(".l.jsonl.dmoe-lock");
  {
    ExclusiveLock first;
    ASSERT_EQ(first.lock_transient_file(lock, "--log"), Outcome::held);
    EXPECT_TRUE(fs::exists(lock));
    ExclusiveLock second;
    EXPECT_EQ(second.lock_transient_file(lock, "--log"), Outcome::busy);
    EXPECT_TRUE(fs::exists(lock)) << "a refused second holder removed the first's lock file";
  }
  EXPECT_FALSE(fs::exists(lock)) << "the holder left its lock file";
  std::ofstream(lock).close();  // left by a SIGKILLed holder: empty, nobody holds it
  {
    ExclusiveLock taken;
    EXPECT_EQ(taken.lock_transient_file(lock, "--log"), Outcome::held);
  }
  EXPECT_FALSE(fs::exists(lock));
  // A file with content at the name is no lock of dmoe's: refused, kept.
  std::ofstream(lock) << "a user's text";
  {
    ExclusiveLock refused;
    try {
      refused.lock_transient_file(lock, "--log");
      ADD_FAILURE() << "a file with content was taken as a lock";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is a file of 13 bytes: that name is the lock file dmoe takes"),
                std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(read_text(lock), "a user's text");
  fs::remove(lock);
  fs::create_symlink(p("victim"), lock);
  {
    ExclusiveLock refused;
    EXPECT_THROW(refused.lock_transient_file(lock, "--log"), Error);
  }
  EXPECT_TRUE(fs::is_symlink(lock));
  EXPECT_FALSE(fs::exists(p("victim")));
  fs::remove(lock);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ExclusiveLock held;
    if (held.lock_transient_file(lock, "--log") != Outcome::held) ::_exit(4);
    ::raise(SIGTERM);
    ::_exit(3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;
  EXPECT_FALSE(fs::exists(lock)) << "SIGTERM left the lock file";
}

// The lock on a file itself (ExclusiveLock::lock_existing_file) holds through its hard links (G23A-3).
TEST_F(OutputFile, AFileLockHoldsThroughEveryNameOfTheFile) {
  using Outcome = ExclusiveLock::Outcome;
  write_file_atomically(p("a.jsonl"), std::string_view("{}\n"));
  fs::create_hard_link(p("a.jsonl"), p("b.jsonl"));
  ExclusiveLock first, second, missing;
  ASSERT_EQ(first.lock_existing_file(p("a.jsonl")), Outcome::held);
  EXPECT_EQ(second.lock_existing_file(p("b.jsonl")), Outcome::busy);
  EXPECT_EQ(missing.lock_existing_file(p("none.jsonl")), Outcome::unavailable);
}

}  // namespace
}  // namespace dmoe
