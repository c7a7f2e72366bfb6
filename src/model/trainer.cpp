// trainer.cpp — the CPU training loop of a Mixtral model (see trainer.hpp).
#include "model/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <climits>
#include <cstring>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numbers>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench/device_probe.hpp"
#include "comm/comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "core/random.hpp"
#include "core/resource_probe.hpp"
#include "cpu/model_kernels.hpp"
#include "flow/cpu_executor.hpp"
#include "flow/cuda_executor.hpp"
#include "flow/task_graph.hpp"
#include "flow/tuner.hpp"
#include "model/checkpoint.hpp"
#include "model/config_io.hpp"
#include "model/mixtral.hpp"
#include "model/train_replica.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The __metadata__ entry with which train --save tags model.safetensors and optimizer.safetensors: the step of
// trainer_state.json they were saved with (HF readers ignore entries other than "format").
constexpr const char* kStepMetadata = "dmoe_train_step";
// And the save they belong to: one random id per save, in both files' __metadata__ and in trainer_state.json
// ("save_id"). The step alone let a file copied from another run's checkpoint of the same step (another --lr, another
// seed) be resumed beside this run's others without a word: the moments of one model applied to another.
constexpr const char* kSaveIdMetadata = "dmoe_save_id";

std::string new_save_id() {
  std::random_device device;
  const uint64_t time = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  const uint64_t id = (uint64_t(device()) << 32 ^ uint64_t(device())) ^ (time * 0x9E3779B97F4A7C15ull);
  return fmt::format("{:016x}", id);
}

// The lock file beside a file that a run replaces by a rename (the tuning file, --log): ".NAME.dmoe-lock" beside the
// file the path resolves to (weakly_canonical: every link of the part that exists; the name as given where it cannot
// be resolved, a working directory past PATH_MAX). Where that name would pass NAME_MAX (a valid name of 245-255
// bytes), NAME is cut and a hash of the whole name added, so that every run still finds the same lock file (the lock
// was skipped there, G23A-4).
fs::path lock_file_beside(const std::string& file) {
  std::error_code ec;
  fs::path path = fs::weakly_canonical(fs::absolute(file, ec), ec);
  if (ec || path.filename().empty()) path = fs::path(file);
  const std::string name = path.filename().string(), suffix = ".dmoe-lock";
  std::string lock = "." + name + suffix;
  if (lock.size() > size_t(NAME_MAX)) {
    uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a: the same in every build
    for (const unsigned char c : name) hash = (hash ^ c) * 0x100000001b3ull;
    const std::string tag = fmt::format("~{:016x}", hash);
    lock = "." + name.substr(0, size_t(NAME_MAX) - 1 - tag.size() - suffix.size()) + tag + suffix;
  }
  return (path.has_parent_path() ? path.parent_path() : fs::path(".")) / lock;
}

// Whether a directory has the append-only attribute (chattr +a): a file made there cannot be removed.
bool append_only_directory(const fs::path& directory) {
  const int fd = ::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  int flags = 0;
  const bool append = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0 && (flags & FS_APPEND_FL);
  ::close(fd);
  return append;
}

// One run at a time writes a log (L21-log of the twenty-first pass): two runs with one --log and two --save
// directories each wrote the log of their own run, and the last to publish replaced the other's (or, resumed, both
// appended their lines to it). The writing process holds two locks, and a second run is refused before it trains:
// - the lock file beside the log (lock_file_beside; ExclusiveLock::lock_transient_file: it exists only while held),
//   since a new run replaces the log by a rename, which a lock on the log itself would not survive;
// - the log file itself where it exists, which holds through every name of the file: one log reached through two hard
//   links took two lock files (G23A-3), and two resumed runs appended to it.
// Neither is taken where it cannot be: no lock file in a directory this process may not write (a resumed run may
// append to a log it may write there) or in an append-only one (it could not be removed, G23A-8), no file lock on a
// log that does not exist yet; a run with neither says so.
class LogLock {
 public:
  void take(const std::string& log_path, std::string_view option, const std::function<void(const std::string&)>& print) {
    const auto busy = [&](const std::string& holder) {
      return fmt::format("{} {}: another dmoe run is writing this log now (it holds {}): wait for it to end, or give "
                         "another {}", option, log_path, holder, option);
    };
    struct stat st {};
    const bool exists = ::stat(log_path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
    if (exists)
      DMOE_REQUIRE_INPUT(file_.lock_existing_file(log_path) != ExclusiveLock::Outcome::busy, "{}",
                         busy("a lock on the log file"));
    const fs::path lock = lock_file_beside(log_path);
    std::string why;
    ExclusiveLock::Outcome beside = ExclusiveLock::Outcome::unavailable;
    if (append_only_directory(lock.parent_path()))
      why = "its directory is append-only (chattr +a): a lock file made there could not be removed";
    else
      beside = beside_.lock_transient_file(lock.string(), fmt::format("{} {}", option, log_path), &why);
    DMOE_REQUIRE_INPUT(beside != ExclusiveLock::Outcome::busy, "{}", busy("'" + lock.string() + "'"));
    if (beside == ExclusiveLock::Outcome::unavailable && !exists)
      print(fmt::format("train: note: {} {}: no lock file can be made beside it ('{}': {}), so another run writing this "
                        "log at the same time would not be refused", option, log_path, lock.string(), why));
  }

 private:
  ExclusiveLock file_, beside_;
};

}  // namespace

std::string complete_interrupted_save(const std::string& dir, const std::string& log_path) {
  const std::string journal = (fs::path(dir) / kCheckpointJournal).string();
  std::vector<NamedPath> outputs;
  if (!log_path.empty()) outputs.push_back({"--log", log_path});
  // G22A-2: the journal of a run committing into this directory now (not killed) was taken for an interrupted save
  // and completed: that run's own renames then failed and it said its save had failed, and a completion racing its
  // undo could leave a mixed set. A saving run holds the directory's lock (train_mixtral's save_lock, LOCK_EX) from
  // before its training to its end; a journal is completed only under that lock, shared (every rank of a resumed job
  // completes the same journal, by design), and refused while another run holds it. Where flock is not supported, as
  // before.
  struct DirectoryLock {
    int fd = -1;
    ~DirectoryLock() {
      if (fd >= 0) ::close(fd);
    }
  } lock;
  struct stat js {};
  if (::lstat(journal.c_str(), &js) == 0) {
    lock.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (lock.fd >= 0 && ::flock(lock.fd, LOCK_SH | LOCK_NB) != 0)
      DMOE_REQUIRE_INPUT(errno != EWOULDBLOCK, "--resume {}: another dmoe run is saving into this directory now (it "
                         "holds the directory's lock, and '{}' is the journal of its save in progress, not of an "
                         "interrupted one): wait for it to end, then resume", dir, journal);
  }
  // G23A-11: completing the journal renames the killed run's log onto --log: first the log's locks, so that a run
  // writing that log now is not cut off from it (it appended on to the replaced file, all its lines lost, rc 0). Taken
  // again, after this, by the training itself; by rank 0 of a job of processes, as there (the ranks would refuse each
  // other).
  LogLock log_lock;
  if (!log_path.empty() && ::lstat(journal.c_str(), &js) == 0 && detect_process_env().rank == 0)
    log_lock.take(log_path, "--log", [](const std::string&) {});
  std::string left, failure;
  const std::string completed = finish_interrupted_commit(journal, outputs, &left, &failure);
  std::string note;
  // What stopped the save: a rename that failed (recorded in the journal, G21-9), else a kill or a power cut.
  if (!completed.empty())
    note = fmt::format("train: note: --resume {}: its last save {}; completed it from {}, renaming its new files onto {}",
                       dir, failure.empty() ? "was interrupted between the renames of its files (the process was "
                                              "killed, or the machine stopped)"
                                            : fmt::format("failed part-way and could not be undone ({})", failure),
                       journal, completed);
  // The save was publishing a new run's log, and this run has no --log: the checkpoint is whole without it, and this
  // run writes no log that could be mixed; the lines are left where they are, said here rather than refused.
  if (!left.empty())
    note += fmt::format("{}train: note: --resume {}: its last save was also putting its run's log in place, and this "
                        "run has no --log: that log is left as it is, its new lines in {}", note.empty() ? "" : "\n",
                        dir, left);
  return note;
}

namespace {

// G22A-11: a save whose rename failed and whose undo could not put a file back leaves that file's earlier content in a
// hidden backup beside it (".NAME.dmoe-old.PID.N", named in the save's error, its journal removed): a later resume
// said only "files of two different saves ... resume from another checkpoint". Its errors for a mixed checkpoint now
// name each such backup, with the mv that puts it back.
std::string backups_beside(const std::string& dir) {
  std::string found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.find(".dmoe-old.");
    if (name.size() < 2 || name[0] != '.' || at == std::string::npos || at < 2) continue;
    const std::string original = name.substr(1, at - 1);
    const bool ours = original == "model.safetensors" || original == "optimizer.safetensors" ||
                      original == "config.json" || original == "trainer_state.json";
    found += fmt::format("{}{}", found.empty() ? "" : "; ",
                         ours ? fmt::format("mv '{}' '{}'", it->path().string(), (fs::path(dir) / original).string())
                              : fmt::format("'{}'", it->path().string()));
  }
  if (found.empty()) return {};
  return fmt::format(". Beside them are hidden backups that a save which failed could not put back (each holds the "
                     "earlier content of the file its name begins with); to restore the checkpoint that save was "
                     "replacing: {}", found);
}

// A resumed run's log, cut back to the checkpoint's step: the lines of steps past it (logged by a run stopped after
// its last save) would otherwise be followed by the same steps again, and a half-written last line by more lines.
// Lines that are not a dmoe step record are kept. Says what was cut, and when the log ends before the checkpoint.
// Lines past the checkpoint are cut only when the log's line of the checkpoint's step shows the state's loss: a state
// without one (written before 2026-12-07) cannot show the log is this run's, and cutting another run's log lost its
// lines (F4 of the eighteenth bad-input pass); that is refused, the file unchanged. `state_file` names the state.
void trim_resumed_log(GrowingOutputFile& log, const std::string& path, int64_t checkpoint_step,
                      std::optional<double> checkpoint_loss, const std::string& state_file,
                      const std::function<void(const std::string&)>& print) {
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // A last line whole but for its newline (an editor's save) is a line: it used to be cut as half-written.
  bool add_newline = false;
  if (!text.empty() && text.back() != '\n') {
    const size_t last_newline = text.rfind('\n');
    const size_t begin = last_newline == std::string::npos ? 0 : last_newline + 1;
    if (json::parse(text.begin() + std::ptrdiff_t(begin), text.end(), nullptr, false).is_object()) {
      text += '\n';
      add_newline = true;
    }
  }
  size_t keep = 0, cut_lines = 0;
  int64_t last_kept = 0, first_cut = -1, last_cut = -1;
  bool verified = false;  // the line of the checkpoint's step shows the state's loss
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = text.find('\n', begin);
    if (end == std::string::npos) {  // a half-written last line
      ++cut_lines;
      break;
    }
    const json line = json::parse(text.begin() + std::ptrdiff_t(begin), text.begin() + std::ptrdiff_t(end), nullptr,
                                  /*allow_exceptions=*/false);
    const bool step_line = line.is_object() && line.contains("step") && line.at("step").is_number_integer();
    const int64_t s = step_line ? line.at("step").get<int64_t>() : 0;
    // Before anything is cut: the line of the checkpoint's step must show its loss (JSON numbers round-trip exactly).
    if (step_line && s == checkpoint_step && checkpoint_loss && line.contains("loss") && line.at("loss").is_number())
      DMOE_REQUIRE_INPUT(line.at("loss").get<double>() == *checkpoint_loss, "--log {}: its line of step {} has loss {}, "
                         "but the checkpoint's step {} had loss {}: it is another run's log, whose lines past step {} "
                         "this resume would cut; give the saved run's log, or a new --log name (the file is unchanged)",
                         path, s, line.at("loss").dump(), s, json(*checkpoint_loss).dump(), s);
    if (step_line && s == checkpoint_step && checkpoint_loss && line.contains("loss") && line.at("loss").is_number())
      verified = true;
    if (step_line && s > checkpoint_step) {
      DMOE_REQUIRE_INPUT(verified, "--log {}: this resume would cut its lines past the checkpoint's step {} (from step "
                         "{} on), but {}: nothing shows that the log is the saved run's, and another run's log would "
                         "lose those lines; give the saved run's log with the lines past step {} removed, or a new "
                         "--log name (the file is unchanged)", path, checkpoint_step, s,
                         checkpoint_loss ? fmt::format("it has no line of step {} with a loss to compare with the "
                                                       "checkpoint's", checkpoint_step)
                                         : fmt::format("{} has no 'loss' (the loss of its step, which dmoe records "
                                                       "since 2026-12-07)", state_file),
                         checkpoint_step);
      cut_lines += 1 + size_t(std::count(text.begin() + std::ptrdiff_t(end) + 1, text.end(), '\n'));
      first_cut = s;
      for (size_t b = end + 1; b < text.size();) {  // the last step among the lines cut, for the note
        const size_t e = text.find('\n', b);
        const json l = json::parse(text.begin() + std::ptrdiff_t(b),
                                   e == std::string::npos ? text.end() : text.begin() + std::ptrdiff_t(e), nullptr, false);
        if (l.is_object() && l.contains("step") && l.at("step").is_number_integer()) last_cut = l.at("step").get<int64_t>();
        if (e == std::string::npos) break;
        b = e + 1;
      }
      break;
    }
    if (step_line) last_kept = s;
    keep = end + 1;
    begin = end + 1;
  }
  if (add_newline && keep == text.size()) log.write("\n", "the newline its last line lacked");
  if (keep < text.size()) {
    log.truncate(std::min<uint64_t>(keep, text.size() - (add_newline ? 1 : 0)));
    print(fmt::format("train: note: --log {}: cut {} line(s) past the checkpoint's step {}{} (logged after its last "
                      "save by the run that stopped); this run logs them again", path, cut_lines, checkpoint_step,
                      first_cut >= 0 ? fmt::format(": those of steps {}..{}", first_cut, std::max(first_cut, last_cut))
                                     : ": a half-written last line"));
  }
  if (last_kept < checkpoint_step)
    print(fmt::format("train: note: --log {} ends at step {} but the checkpoint is at step {}: it has no line of {} "
                      "(the run that saved may have stopped before writing it, or this log is another run's or one "
                      "given only now); this run's lines follow from step {}", path, last_kept, checkpoint_step,
                      last_kept + 1 == checkpoint_step ? fmt::format("step {}", checkpoint_step)
                                                       : fmt::format("steps {}..{}", last_kept + 1, checkpoint_step),
                      checkpoint_step + 1));
}

// The bytes of a file, or of every regular file of a directory in name order. The error_code forms: a symbolic link
// loop (the path itself, or an entry) threw filesystem_error, "unexpected error" with rc 2; an entry that is no
// regular file (a loop, a dangling link, a FIFO) is skipped like the others.
// `other_bytes`: the memory the run needs beside the text (its model and activations), for the check before reading.
std::vector<uint8_t> read_corpus(const std::string& path, double other_bytes,
                                 const std::function<void(const std::string&)>& print) {
  std::vector<fs::path> files;
  std::vector<std::string> subdirectories;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (fs::is_directory(status)) {
    fs::directory_iterator it(path, ec), end;
    DMOE_REQUIRE_INPUT(!ec, "--data {}: the directory cannot be read: {}", path, ec.message());
    for (; it != end; it.increment(ec)) {
      DMOE_REQUIRE_INPUT(!ec, "--data {}: the directory cannot be read: {}", path, ec.message());
      std::error_code entry_ec;
      if (fs::is_regular_file(it->path(), entry_ec)) files.push_back(it->path());
      else if (fs::is_directory(it->path(), entry_ec)) subdirectories.push_back(it->path().filename().string());
    }
    std::sort(files.begin(), files.end());
    // Text in DIR/en/ and DIR/de/ beside a README trained on the README alone, without a word (G21-11 of the
    // twenty-first pass). --data reads one level on purpose (a corpus directory may hold other data beneath it, and
    // what is read must be what `ls DIR` shows); the skipped subdirectories are named.
    if (!subdirectories.empty()) {
      std::sort(subdirectories.begin(), subdirectories.end());
      std::string names;
      for (size_t i = 0; i < subdirectories.size() && i < 5; ++i) names += (i ? ", " : "") + subdirectories[i];
      if (subdirectories.size() > 5) names += ", ...";
      print(fmt::format("train: note: --data {}: skipped {} subdirector{} ({}): --data reads only the regular files "
                        "directly in the directory, not those in its subdirectories; give a subdirectory as --data to "
                        "train on its files", path, subdirectories.size(), subdirectories.size() == 1 ? "y" : "ies",
                        names));
    }
  } else {
    // What it is, when it is neither: a FIFO was "not a file or directory", which it is, in a sense.
    const fs::file_type type = status.type();
    const char* kind = type == fs::file_type::not_found ? "does not exist"
                       : type == fs::file_type::fifo    ? "is a FIFO (named pipe)"
                       : type == fs::file_type::socket  ? "is a socket"
                       : type == fs::file_type::character ? "is a character device"
                       : type == fs::file_type::block   ? "is a block device"
                                                        : "cannot be read as a file";
    DMOE_REQUIRE_INPUT(fs::is_regular_file(status), "--data {}: {}{}; allowed: a regular text file, or a directory of "
                       "them (read whole before training, so not a pipe or a device)", path, kind,
                       ec && type != fs::file_type::not_found ? " (" + ec.message() + ")" : "");
    files.push_back(path);
  }
  // The text is held in memory whole: a --data larger than the memory (a 64 GiB file) was read for minutes without a
  // word and then ran out of memory ("make it smaller (--batch, --seq ...)", which named none of it). Its size first.
  double total = 0;
  for (const fs::path& f : files) {
    std::error_code size_ec;
    const uintmax_t size = fs::file_size(f, size_ec);
    if (!size_ec) total += double(size);
  }
  require_host_memory(total + other_bytes,
                      fmt::format("train --data {} ({} of text in {} file(s), read into memory whole, beside the "
                                  "model's {})", path, format_bytes(total), files.size(), format_bytes(other_bytes)),
                      "a smaller --data: fewer or shorter files");
  // A large text was read for many seconds before the first line (3 GB: 12 s, G16 of the sixteenth pass): said first.
  if (total >= double(1ull << 30))
    print(fmt::format("train: reading --data {} ({} in {} file(s)) into memory", path, format_bytes(total),
                      files.size()));
  std::vector<uint8_t> bytes;
  bytes.reserve(size_t(std::min(total, 1e15)));
  for (const fs::path& f : files) {
    errno = 0;
    std::ifstream in(f, std::ios::binary);
    // With the reason, as a safetensors input says it ("cannot read 'x.txt'" alone: G20-12 of the twentieth pass).
    DMOE_REQUIRE_INPUT(in.good(), "--data: cannot read '{}': {}", f.string(),
                       errno != 0 ? std::strerror(errno) : "cannot be opened");
    // In blocks (a byte-wise iterator read at ~250 MB/s), to the end of the file, but not far past the size it had
    // when the memory was checked: /proc/self/pagemap (size 0) read 256 GB of zeros into a bad_alloc blamed on the
    // model (H13 of the seventeenth pass).
    std::error_code size_ec;
    const uintmax_t expected = fs::file_size(f, size_ec);
    const size_t start = bytes.size();
    std::vector<char> block(size_t(1) << 22);
    while (in) {
      in.read(block.data(), std::streamsize(block.size()));
      bytes.insert(bytes.end(), block.data(), block.data() + in.gcount());
      DMOE_REQUIRE_INPUT(size_ec || bytes.size() - start <= expected + (uintmax_t(64) << 20), "--data: '{}' reads past "
                         "its size ({} bytes) by more than 64 MiB: a /proc or /sys file, or one that grows while it is "
                         "read; allowed: text files", f.string(), expected);
    }
    DMOE_REQUIRE_INPUT(in.eof(), "--data: reading '{}' failed after {} bytes", f.string(), bytes.size());
  }
  return bytes;
}

// Adam moments of one rank's share, laid out like the weights.
struct Moments {
  MixtralWeights m, v;
};

// The text a run trained on, as its checkpoint records it: a resume compared only the --data path, so a file added to
// the folder between save and resume changed the split and the windows without a word (G13, sixteenth pass).
// 64 bits over 8-byte words, each mixed (multiply, rotate, multiply) before it enters the state and the state rotated
// and multiplied after, as xxHash64's tail does, then a final avalanche. An FNV-1a over whole words, the first
// version, let a change of the high bytes of two words cancel (two letters' case flipped in a licence text gave the
// same fingerprint; H9 of the seventeenth pass).
std::string corpus_fingerprint(const std::vector<uint8_t>& text) {
  constexpr uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                     P4 = 0x85EBCA77C2B2AE63ull;
  const auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  uint64_t h = P3 ^ (uint64_t(text.size()) * P1);
  size_t i = 0;
  for (; i + 8 <= text.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, text.data() + i, 8);
    h ^= rotl(word * P2, 31) * P1;
    h = rotl(h, 27) * P1 + P4;
  }
  for (; i < text.size(); ++i) h = rotl(h ^ (text[i] * P3), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return fmt::format("{:016x}", h);
}

void write_json(const std::string& path, const json& j) { write_file_atomically(path, j.dump(2) + "\n"); }

json read_json(const std::string& path) { return read_json_file(path, "training state"); }

// Adds this run shape's entry to the tuning file, replacing an entry of the same shape. The file is a store shared by
// runs of several shapes, which a sweep may run at once: each run wrote back the list it had read at its start, so the
// last to finish dropped the entries the others had added meanwhile (F2 of the eighteenth bad-input pass). The file is
// read again and written under an exclusive lock (flock on a hidden lock file beside it, ".NAME.dmoe-lock", kept: the
// tuning file itself is replaced by a rename, which a lock on it would not survive). A file that is no tuning file any
// more is left as it is, and said.
// The lock file of a tuning file: beside the file that is replaced, not beside the name given. Two symbolic links to
// one T.json (a/T.json, b/T.json) took two locks (a/.T.json.dmoe-lock, b/...) while the rename went to the one target,
// so two runs each wrote back their own entry and one was lost, rc 0 (G19-5 of the nineteenth bad-input pass). The
// path is resolved (weakly_canonical: every link of the part that exists, the file's own included); where it cannot be
// (a working directory past PATH_MAX), the name as given, as before.
// The same rule gives --log its lock file (lock_file_beside, above).
fs::path tune_file_lock_path(const std::string& tune_file) { return lock_file_beside(tune_file); }

// Before the training: the tuning file's lock file can be opened (it is created here when missing, and locked when the
// entry is written). A directory or a symbolic link at its name (never followed) was found only after all the tuning
// steps, and the run ended without its save or its tuning ("cannot be opened: Is a directory", or for a link "Too
// many levels of symbolic links"; G19-3 of the nineteenth bad-input pass).
void check_tune_lock_file(const TrainOptions& o) {
  const fs::path lock = tune_file_lock_path(o.tune_file);
  // G19-10: --log onto the lock file (as H3, --log onto the save's journal): the log was written there and the lock
  // then sat on an unlinked inode, which a concurrent tuned run would not lock.
  DMOE_REQUIRE_INPUT(o.log_path.empty() || !same_file(o.log_path, lock.string()), "--log '{}' is the lock file of "
                     "--tune-file {} ('{}'), which dmoe creates and locks beside the tuning file while it writes its "
                     "entry: give another --log", o.log_path, o.tune_file, lock.string());
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(lock, ec);
  const char* what = fs::is_symlink(st) ? "a symbolic link" : fs::is_directory(st) ? "a directory" : nullptr;
  DMOE_REQUIRE_INPUT(!what, "--tune-file {}: '{}' is {}: that name is the lock file dmoe takes beside the tuning file "
                     "while it writes its entry (a regular file, created when missing; a link there is never "
                     "followed); move it away", o.tune_file, lock.string(), what);
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  DMOE_REQUIRE_INPUT(fd >= 0, "--tune-file {}: its lock file '{}' cannot be opened or created ({}): dmoe locks it while "
                     "it writes the tuning entry; make it a writable regular file, or give a --tune-file in a "
                     "writable directory", o.tune_file, lock.string(), std::strerror(errno));
  ::close(fd);
}

void add_tune_entry(const std::string& tune_file, const json& key, const json& entry,
                    const std::function<void(const std::string&)>& print) {
  const fs::path path(tune_file);
  const fs::path lock_path = tune_file_lock_path(tune_file);
  ExclusiveLock lock;
  lock.lock_file(lock_path.string(), "--tune-file", /*wait=*/true);
  json runs = json::array();
  std::error_code ec;
  if (fs::exists(path, ec)) {
    std::string problem;
    try {
      const json t = read_json_file(tune_file, "Flow tuning file");
      if (!t.is_object() || t.size() != 1 || !t.contains("runs") || !t["runs"].is_array())
        problem = "it holds something else than {\"runs\": [...]} now";
      else
        runs = t["runs"];
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!problem.empty()) {
      print(fmt::format("train: note: --tune-file {}: the choice was not written: the file changed during the run and "
                        "is no Flow tuning file ({}); it is left as it is", tune_file, problem));
      return;
    }
  }
  json kept = json::array();
  for (const json& run : runs)
    if (!(run.is_object() && run.contains("key") && run["key"] == key)) kept.push_back(run);
  kept.push_back(entry);
  write_json(tune_file, json{{"runs", kept}});
}

// Tensors under name_prefix + HF name from one file into w (all shapes checked). AdamW's moments must be finite, the
// second one >= 0 (its square root divides the step): a NaN there made NaN weights after the first resumed step.
void read_prefixed(const SafetensorsFile& f, const std::string& name_prefix, MixtralWeights& w, const MixtralConfig& c,
                   bool non_negative) {
  for (ParamView& p : parameter_views(w, c)) {
    DMOE_REQUIRE_INPUT(f.has(name_prefix + p.name), "{}: tensor '{}' is missing", f.source(), name_prefix + p.name);
    f.read_f32_into(name_prefix + p.name, p.shape, p.data);
    for (int64_t i = 0; i < p.numel; ++i)
      DMOE_REQUIRE_INPUT(std::isfinite(p.data[i]) && (!non_negative || p.data[i] >= 0),
                         "{}: tensor '{}' element {} is {}; AdamW's moments must be finite{}", f.source(),
                         name_prefix + p.name, i, p.data[i], non_negative ? " and >= 0" : "");
  }
}

// The cosine's floor: --min-lr, or lr / 10 when it is not given (min_lr < 0).
double effective_min_lr(const TrainOptions& o) { return o.min_lr < 0 ? o.lr / 10 : o.min_lr; }

}  // namespace

double scheduled_lr(const TrainOptions& o, int64_t step) {
  const double min_lr = effective_min_lr(o);
  if (o.warmup > 0 && step <= o.warmup) return o.lr * double(step) / double(o.warmup);
  if (o.steps <= o.warmup) return o.lr;
  // With a warm-up the peak is its last step (t = warmup) and the cosine runs over the steps after it. Without one
  // the cosine starts at step 1: it started a step later, so no step used --lr, and `--steps 1 --warmup 0 --min-lr 0`
  // trained at lr 0 (the saved model was the initial one, rc 0).
  const double progress = o.warmup > 0 ? std::min(1.0, double(step - o.warmup) / double(o.steps - o.warmup))
                          : o.steps > 1 ? std::min(1.0, double(step - 1) / double(o.steps - 1)) : 0.0;
  return min_lr + (o.lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

TrainResult train_mixtral(const MixtralConfig& config, const TrainOptions& o,
                          const std::function<void(const std::string&)>& print_fn) {
  config.validate();
  auto print = [&](const std::string& line) {
    if (print_fn) {
      print_fn(line);
    } else {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  };
  DMOE_REQUIRE_INPUT(config.vocab_size >= 256, "train: byte-level data needs vocab_size >= 256 (config has {})",
               config.vocab_size);
  DMOE_REQUIRE_INPUT(o.steps >= 1, "train: --steps = {} must be >= 1", o.steps);
  // The value of an option as the errors below name it: "--beta2 1" as given, or, taken by a bare --resume from the
  // saved state, the file and its key (they named --min-lr, --seq or --beta2 that nobody had given: F9 of the
  // eighteenth bad-input pass).
  const auto named = [&](const std::string& option, const auto& value) {
    if (!o.from_state.count(option)) return fmt::format("{} {}", option, value);
    std::string key = option.substr(2);
    std::replace(key.begin(), key.end(), '-', '_');
    return fmt::format("{}'s '{}' = {} (--resume {}: the saved run's; give {} to replace it)",
                       (fs::path(o.resume_dir) / "trainer_state.json").string(), key, value, o.resume_dir, option);
  };
  // A bare resume's batch is trainer_state.json's: these named "--batch", which was not given (G22A-10 of the
  // twenty-second pass; F9's naming did not reach them).
  DMOE_REQUIRE_INPUT(o.world >= 1 && o.batch >= 1 && o.batch % o.world == 0,
               "train: the batch, {}, must split evenly over --world {} ranks", named("--batch", o.batch), o.world);
  DMOE_REQUIRE_INPUT(o.micro_batches >= 1 && (o.batch / o.world) % o.micro_batches == 0,
               "train: the {} sequences per rank ({} / --world {}) do not split into --micro-batches {}",
               o.batch / o.world, named("--batch", o.batch), o.world, o.micro_batches);
  DMOE_REQUIRE_INPUT(config.num_local_experts % o.world == 0,
               "train: num_local_experts = {} is not divisible by --world = {}", config.num_local_experts, o.world);
  DMOE_REQUIRE_INPUT(o.seq >= 2, "train: --seq = {} must be >= 2", o.seq);
  // Before the data and the weights are read (it came after both, once the run had printed its first line).
  DMOE_REQUIRE_INPUT(o.engine == "cuda" || o.dtype == DType::f32, "train: --dtype {} on the CPU engine; it trains in "
                     "f32 (allowed: f32; bf16 with --engine cuda)", dtype_name(o.dtype));
  DMOE_REQUIRE_INPUT(o.resume_dir.empty() || o.init == "random", "train: --init {} and --resume {}: a resumed run starts "
                     "from its checkpoint's weights, so --init would be ignored; give one of them", o.init, o.resume_dir);
  std::optional<flow::TaskGraph> flow_graph;  // --schedule (not tuned): every step is this graph on the engine's executor
  const bool tuned = !o.schedule.empty() && flow::parse_schedule(o.schedule, "--schedule") == flow::Schedule::tuned;
  auto make_graph = [&](flow::Schedule s, int32_t micro_batches, int64_t chunk_bytes) {
    flow::GraphSpec spec;
    spec.layers = config.num_hidden_layers;
    spec.micro_batches = micro_batches;
    spec.schedule = s;
    flow::set_mixtral_grad_layout(spec, config, o.engine == "cuda" ? flow::cuda_mixtral_dense_grad_bytes_per_layer(config)
                                                                   : flow::mixtral_dense_grad_bytes_per_layer(config));
    spec.chunk_bytes = std::max<int64_t>(4, chunk_bytes / 4 * 4);  // the executor cuts on 4-byte elements
    return flow::build_task_graph(spec);
  };
  if (!o.schedule.empty()) {
    const flow::Schedule s = flow::parse_schedule(o.schedule, "--schedule");
    if (tuned) {
      DMOE_REQUIRE_INPUT(o.micro_batches == 1, "train: --schedule tuned chooses R itself; drop --micro-batches {} (or "
                         "give a fixed schedule: vanilla, pipe-moe, pipe-attn, chunked-ar)", o.micro_batches);
      DMOE_REQUIRE_INPUT(o.tune_samples >= 2 && o.tune_steps >= 1, "train: --tune-samples {} must be >= 2 and "
                         "--tune-steps {} >= 1", o.tune_samples, o.tune_steps);
    }
    DMOE_REQUIRE_INPUT(!config.tie_word_embeddings, "train: --schedule needs untied embeddings (tie_word_embeddings = "
                       "false): the executor refuses tied ones");
    // At most 2^40, as a tuning file's choice: near INT64_MAX the chunk count overflowed and the dense gradients were
    // never all-reduced (the ranks trained apart, rc 0; G20-3). A chunk as large as the gradients is one all-reduce.
    DMOE_REQUIRE_INPUT(o.chunk_bytes >= 4 && o.chunk_bytes % 4 == 0 && o.chunk_bytes <= flow::kMaxChunkBytes,
                       "train: --chunk-bytes {} must be a positive multiple of 4 of at most 2^40 = {} (a chunk at least "
                       "as large as the gradients is one all-reduce)", o.chunk_bytes, flow::kMaxChunkBytes);
    if (!tuned) flow_graph = make_graph(s, o.micro_batches, o.chunk_bytes);
  }
  // The sequence's floor is 2 (each position predicts the next; --seq 1 is refused by its option): the range said 1.
  if (o.from_state.count("--seq"))
    config.check_sequence(o.seq, fmt::format("train: {}'s 'seq' (--resume {}: the saved run's; give --seq to replace "
                                             "it) =", (fs::path(o.resume_dir) / "trainer_state.json").string(),
                                             o.resume_dir), 2);
  else
    config.check_sequence(o.seq, "train: --seq", 2);
  // One rule a message, naming its option and the allowed range (all four rules were one message, whichever failed).
  // NaN fails each comparison, so it is named by the rule of its option.
  DMOE_REQUIRE_INPUT(o.lr > 0 && std::isfinite(o.lr), "train: {} must be finite and > 0", named("--lr", o.lr));
  DMOE_REQUIRE_INPUT(o.warmup >= 0, "train: {} must be >= 0 (steps of the linear warm-up)", named("--warmup", o.warmup));
  DMOE_REQUIRE_INPUT(o.clip >= 0 && std::isfinite(o.clip), "train: {} must be finite and >= 0 (0: no clipping)",
                     named("--clip", o.clip));
  DMOE_REQUIRE_INPUT(o.val_fraction > 0 && o.val_fraction < 1, "train: {} must be in (0, 1)",
                     named("--val-fraction", o.val_fraction));
  // AdamW's hyper-parameters: outside these ranges the moments or the decay diverge (NaN weights later).
  DMOE_REQUIRE_INPUT(o.beta1 >= 0 && o.beta1 < 1, "train: {} must be in [0, 1)", named("--beta1", o.beta1));
  DMOE_REQUIRE_INPUT(o.beta2 >= 0 && o.beta2 < 1, "train: {} must be in [0, 1)", named("--beta2", o.beta2));
  DMOE_REQUIRE_INPUT(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "train: {} must be finite and >= 0",
                     named("--weight-decay", o.weight_decay));
  // The decoupled decay multiplies the weight matrices by 1 - lr * weight_decay each step: at 1 or more it zeroes or
  // flips them, and `--weight-decay 1e300` trained on until the router's "logits contain NaN" a step later.
  DMOE_REQUIRE_INPUT(o.lr * o.weight_decay < 1, "train: {} with {}: AdamW's decay multiplies the weights by 1 - lr x "
                     "weight_decay = {:g} each step, which zeroes or flips them; give lr x weight_decay < 1 (the "
                     "default decay is 0.1)", named("--weight-decay", o.weight_decay), named("--lr", o.lr),
                     1 - o.lr * o.weight_decay);
  // (A negative --min-lr is refused by its option since the eleventh pass; < 0 here is "not given": lr / 10.)
  DMOE_REQUIRE_INPUT(o.min_lr < 0 || (o.min_lr <= o.lr && std::isfinite(o.min_lr)),
                     "train: {} must be <= {} (the cosine decays from lr to min_lr; leave --min-lr out for the "
                     "default, lr/10)", named("--min-lr", o.min_lr), named("--lr", o.lr));
  // A stop past the schedule's end was min(stop_after, steps) without a word (`--steps 2 --stop-after 50`: 2 steps).
  DMOE_REQUIRE_INPUT(o.stop_after <= o.steps, "train: --stop-after {} is past the last step of the schedule (--steps "
                     "{}): it stops after one of its steps, 1 to {}; give --steps {} for a longer run, or leave out "
                     "--stop-after", o.stop_after, o.steps, o.steps, o.stop_after);

  // A batch that cannot fit is refused before the data is read (it used to end in a bare std::bad_alloc after the
  // first line). On the GPU the activations are on the device. On either engine the host holds the whole f32 model and
  // its two AdamW moments (full, full_m, full_v below): a model that fits the swap but not the memory was only found
  // by filling it, and one past the address space ended in the last-resort bad_alloc message.
  const double host_model_bytes = 12.0 * double(config.num_parameters());
  const double host_run_bytes =
      host_model_bytes + (o.engine == "cuda" ? 0.0
                                             : model_activation_bytes_lower_bound(double(o.batch) * double(o.seq),
                                                                                  config.vocab_size, config.hidden_size,
                                                                                  config.num_hidden_layers));
  if (o.engine != "cuda")
    require_host_memory(host_run_bytes,
                        fmt::format("train (batch {} x seq {} on the CPU engine: at least the f32 weights and their "
                                    "two AdamW moments, the logits, their gradient and two activations per layer)",
                                    o.batch, o.seq),
                        std::string("--batch, --seq, or ") + kModelSizes);
  else
    require_host_memory(host_model_bytes, "train (the f32 weights and their two AdamW moments on the host)",
                        kModelSizes);
  // The held-out windows are kept as tokens for the whole run: --val-batches 1048576 at batch 64 x seq 256 (64 GiB)
  // ended in a bad_alloc blamed on --batch and --seq (G20-8 of the twentieth pass).
  const double val_token_bytes = 4.0 * double(std::max<int64_t>(1, o.val_batches)) * double(o.batch) * double(o.seq);
  require_host_memory((o.engine == "cuda" ? host_model_bytes : host_run_bytes) + val_token_bytes,
                      fmt::format("train's validation set (--val-batches {} x batch {} = {:.0f} held-out windows of seq {} "
                                  "tokens, {} kept for the run, beside the model's {})", o.val_batches, o.batch,
                                  double(std::max<int64_t>(1, o.val_batches)) * double(o.batch), o.seq,
                                  format_bytes(val_token_bytes),
                                  format_bytes(o.engine == "cuda" ? host_model_bytes : host_run_bytes)),
                      "a smaller --val-batches, or --batch, --seq");

  // Open at once: the log, a checkpoint's files and their temporaries, a data file, the threads' pipes (F18 of the
  // fifteenth pass: under ulimit -n 4 the whole run trained, then its save failed).
  require_file_descriptors(16, "train (its --log, the --save checkpoint's files and their temporaries, --data)");
  // The checkpoint (the f32 model and its two AdamW moments; each file's temporary is written before the old one goes)
  // on a file system without room for it failed only after the whole training: checked now, as init-model does.
  if (!o.save_dir.empty()) {
    std::error_code ec;
    fs::path existing = fs::absolute(o.save_dir, ec);
    int64_t new_directories = 0;  // made by the first save
    while (!existing.empty() && !fs::exists(existing, ec) && existing != existing.parent_path()) {
      new_directories += !existing.filename().empty();  // "ck/" is one directory
      existing = existing.parent_path();
    }
    const double bytes = host_model_bytes;
    const std::optional<uint64_t> free = disk_free_bytes(existing.string());
    // A save keeps the checkpoint before it until its own files are complete: where the directory holds none yet and
    // --save-every saves more than once, the second save needs room for two (G17, sixteenth pass: it failed after the
    // training). Where one is there already, the space it takes comes back with each save.
    const bool holds_one = fs::exists(fs::path(o.save_dir) / "model.safetensors", ec);
    const bool saves_again = o.save_every > 0 && o.save_every < (o.stop_after > 0 ? o.stop_after : o.steps);
    const double needed = holds_one || !saves_again ? bytes : 2 * bytes;
    DMOE_REQUIRE_INPUT(!free || needed <= double(*free), "--save {}: the checkpoint needs about {} (the f32 model and "
                       "its two AdamW moments){} and the file system of '{}' has {} free", o.save_dir,
                       format_bytes(bytes), needed > bytes ? fmt::format(", {} for two of them: --save-every {} saves "
                                                                         "again while the last save is still kept",
                                                                         format_bytes(needed), o.save_every)
                                                           : std::string(),
                       existing.string(), format_bytes(double(*free)));
    // And its files: a save creates the temporaries of its four files and its journal at once, beside the checkpoint
    // it replaces (two saves' worth where the first is kept, as above, and its directories where they are new). A file
    // system out of inodes with bytes free (a tmpfs's nr_inodes) failed the save after the training, as "No space left
    // on device" (G20-5, twentieth pass).
    const int64_t save_files = 5;  // model, config, optimizer, state, journal
    // G22A-3: the run's other new files on the same file system are there when the save creates its own: a new run's
    // log in its temporary (published with the save), the lock file beside the log (while the run lasts), a new tuning
    // file and its lock file. Left out of the count, a file system with exactly the save's inodes free trained every
    // step, then failed the save with "no free inodes".
    int64_t other_files = 0;
    std::string others;
    {
      struct stat save_fs {};
      const bool known = ::stat(existing.c_str(), &save_fs) == 0;
      const auto on_save_fs = [&](const std::string& file) {
        // G23A-5: the directory the file's temporary and lock file are made in, links resolved (as the writer and
        // lock_file_beside resolve them): a --log that is a link from another file system into the save's was counted
        // on the link's file system, and the save failed after all the steps with "no free inodes".
        fs::path dir = lock_file_beside(file).parent_path();
        while (!dir.empty() && !fs::exists(dir, ec) && dir != dir.parent_path()) dir = dir.parent_path();
        struct stat st {};
        return known && ::stat(dir.c_str(), &st) == 0 && st.st_dev == save_fs.st_dev;
      };
      const auto missing = [&](const fs::path& file) { return !fs::exists(fs::symlink_status(file, ec)); };
      if (!o.log_path.empty() && on_save_fs(o.log_path)) {
        // A resumed run appends to its log in place (no temporary); a new run writes a temporary.
        const bool temporary = o.resume_dir.empty() || missing(o.log_path);
        const bool lock = missing(lock_file_beside(o.log_path));
        if (temporary || lock) {
          other_files += int64_t(temporary) + int64_t(lock);
          others += fmt::format(", --log {} ({}{}{})", o.log_path, temporary ? "its temporary" : "",
                                temporary && lock ? " and " : "", lock ? "its lock file" : "");
        }
      }
      if (o.schedule == "tuned" && !o.tune_file.empty() && on_save_fs(o.tune_file)) {
        // An existing tuning file is replaced by its temporary before the save (no inode more); a new one stays.
        const bool file = missing(o.tune_file), lock = missing(tune_file_lock_path(o.tune_file));
        if (file || lock) {
          other_files += int64_t(file) + int64_t(lock);
          others += fmt::format(", --tune-file {} ({}{}{})", o.tune_file, file ? "the tuning file" : "",
                                file && lock ? " and " : "", lock ? "its lock file" : "");
        }
      }
    }
    require_free_inodes(uint64_t((holds_one || !saves_again ? save_files : 2 * save_files - 1) + new_directories +
                                 other_files),
                        existing.string(), fmt::format("--save {} (each save: the temporaries of its four files and "
                                                       "its journal{}){}", o.save_dir,
                                                       holds_one || !saves_again ? "" : ", twice while the first is kept",
                                                       others));
    // Its largest file holds the two moments: 2/3 of it.
    require_file_size_allowed(bytes * 2 / 3, fmt::format("--save {}: optimizer.safetensors (the two AdamW moments)",
                                                         o.save_dir));
  }

  // A step (or a validation) that takes minutes on the CPU was silent after the first line (batch 2^20 x seq 2 ran past
  // a 60 s timeout without a word): say so first. 1 GFLOP/s per core is below what the CPU engine reaches (~2.3 on
  // the 2-core CI machine for the tiny model), so the estimate is an upper one.
  // Each all-reduce chunk of --schedule chunked-ar is a collective of its own: ~100 us on the CPU engine (57K chunks of
  // tiny at --chunk-bytes 4 took 6.3 s a step on the 2-core machine), ~10 us on a GPU (a launch). `--chunk-bytes 40`
  // on gpt2-tiny-moe (1.9M chunks) was silent for over 200 s.
  int64_t ar_chunks = 0;
  if (flow_graph && o.world > 1)
    for (const flow::Task& t : flow_graph->tasks) ar_chunks += t.kind == flow::TaskKind::allreduce;
  const double chunks_s = double(ar_chunks) * (o.engine == "cuda" ? 1e-5 : 1e-4);
  const std::string chunks_note =
      chunks_s > 1 ? fmt::format("; --chunk-bytes {} cuts each step's gradient all-reduce into {} chunks, each a "
                                 "collective of its own (~{:.3g} s of the step; a larger --chunk-bytes, e.g. 1048576, "
                                 "takes far fewer)", o.chunk_bytes, ar_chunks, chunks_s)
                   : std::string();
  if (o.engine == "cuda" && chunks_s > 10)
    print(fmt::format("train: note: a training step may take ~{:.3g} s or more{}", chunks_s, chunks_note));
  if (o.engine != "cuda") {
    const double cores = std::min<double>(o.world, std::max(1u, std::thread::hardware_concurrency()));
    const double step_s = 3 * config.forward_flop(o.batch, o.seq) / (1e9 * cores) + chunks_s;
    const double val_s = config.forward_flop(std::max<int64_t>(1, o.val_batches) * o.batch, o.seq) / (1e9 * cores);
    if (step_s > 10 || val_s > 10)
      print(fmt::format("train: note: on the CPU engine a training step may take up to ~{:.3g} s (batch {} x seq {}) "
                        "and each validation up to ~{:.3g} s (--val-batches {} x batch {} windows), at >= 1 GFLOP/s per "
                        "core on {:.0f} cores; lower --batch/--seq/--val-batches for a quicker run{}", step_s, o.batch,
                        o.seq, val_s, o.val_batches, o.batch, cores, chunks_note));
  }

  // ---- data
  const std::vector<uint8_t> corpus = read_corpus(o.data_path, host_run_bytes, print);
  const std::string corpus_id = corpus_fingerprint(corpus);
  std::error_code ec_dir;
  const int64_t val_bytes = int64_t(double(corpus.size()) * o.val_fraction);
  const int64_t train_bytes = int64_t(corpus.size()) - val_bytes;
  DMOE_REQUIRE_INPUT(train_bytes >= o.seq && val_bytes >= o.seq,
               "train: --data {} has {} bytes{}: too few for --seq {} windows in both the training part ({} bytes) and "
               "the held-out part ({} bytes)", o.data_path, corpus.size(),
               fs::is_directory(o.data_path, ec_dir) ? " (the regular files directly in it; subdirectories are not read)" : "",
               o.seq, train_bytes, val_bytes);
  auto train_batch = [&](int64_t step) {
    Rng rng(o.seed * 0x9e3779b97f4a7c15ull + uint64_t(step));
    std::vector<int32_t> tokens(o.batch * o.seq);
    for (int64_t b = 0; b < o.batch; ++b) {
      const int64_t start = int64_t(rng.next() % uint64_t(train_bytes - o.seq + 1));
      for (int64_t s = 0; s < o.seq; ++s) tokens[b * o.seq + s] = corpus[start + s];
    }
    return tokens;
  };
  const int64_t val_windows = std::max<int64_t>(1, o.val_batches) * o.batch;
  std::vector<int32_t> val_tokens(val_windows * o.seq);
  for (int64_t w = 0; w < val_windows; ++w) {
    const int64_t start = train_bytes + (val_bytes - o.seq) * w / std::max<int64_t>(1, val_windows - 1);
    for (int64_t s = 0; s < o.seq; ++s) val_tokens[w * o.seq + s] = corpus[std::min<int64_t>(start + s, corpus.size() - 1)];
  }

  // ---- start: resume, a checkpoint, or random
  MixtralWeights full;
  MixtralWeights full_m = make_mixtral_weights(config, 0, config.num_local_experts);
  MixtralWeights full_v = make_mixtral_weights(config, 0, config.num_local_experts);
  int64_t first_step = 1;
  std::optional<double> checkpoint_loss;
  if (!o.resume_dir.empty()) {
    // G23A-7: a resume reading the checkpoint while another run committed into it read files of two saves, and was
    // told the (whole) checkpoint was "of two different saves … resume from another checkpoint". A saving run holds the
    // directory's lock (save_lock below, LOCK_EX) from before its training to its end: the checkpoint is read under
    // that lock, shared, and refused while another run holds it (as complete_interrupted_save does, G22A-2). Released
    // at the end of this block, before this run's own save_lock (flock locks of two descriptors of one process
    // conflict). Not taken by the other ranks of a GPU job, whose rank 0 may hold save_lock by then; where flock is not
    // supported, no lock, as before.
    struct ResumeLock {
      int fd = -1;
      ~ResumeLock() {
        if (fd >= 0) ::close(fd);
      }
    } resume_lock;
    if (o.engine != "cuda" || detect_process_env().rank == 0) {
      resume_lock.fd = ::open(o.resume_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (resume_lock.fd >= 0 && ::flock(resume_lock.fd, LOCK_SH | LOCK_NB) != 0)
        DMOE_REQUIRE_INPUT(errno != EWOULDBLOCK, "--resume {}: another dmoe run is saving into this directory now (it "
                           "holds the directory's lock, and its save may be replacing the checkpoint's files as they "
                           "are read): wait for it to end, then resume", o.resume_dir);
    }
    if (const std::string note = complete_interrupted_save(o.resume_dir, o.log_path); !note.empty()) print(note);
    const json state = read_json((fs::path(o.resume_dir) / "trainer_state.json").string());
    DMOE_REQUIRE_INPUT(state.contains("step") && state["step"].is_number_integer(),
                 "{}/trainer_state.json: no integer 'step'", o.resume_dir);
    DMOE_REQUIRE_INPUT(state["step"].get<int64_t>() >= 0, "{}/trainer_state.json: step {} must be >= 0",
                       o.resume_dir, state["step"].get<int64_t>());
    // A checkpoint is saved after a step (--save-every N >= 1, or at the end of at least one): step 0 beside trained
    // weights and AdamW moments was taken, and the run restarted its schedule and bias correction on them.
    DMOE_REQUIRE_INPUT(state["step"].get<int64_t>() >= 1, "{}/trainer_state.json: step 0, but dmoe saves a checkpoint "
                       "only after a step (its weights and moments are trained ones): the state was not written by a "
                       "run; start from the weights with --init {}/model.safetensors instead", o.resume_dir,
                       o.resume_dir);
    first_step = state["step"].get<int64_t>() + 1;
    // An unknown key (a misspelt "learning_rate", an entry another tool added) resumed with rc 0 and no note (G21-10
    // of the twenty-first pass), as if it had been read; the tuning file refuses one. These are the keys a save writes.
    {
      static const std::set<std::string> known{"step", "seed", "steps", "batch", "seq", "lr", "data", "save_id",
                                               "data_bytes", "data_fingerprint", "val_fraction", "warmup", "min_lr",
                                               "weight_decay", "beta1", "beta2", "clip", "loss"};
      for (const auto& [key, value] : state.items()) {
        if (known.count(key)) continue;
        std::string allowed;
        for (const std::string& k : known) allowed += (allowed.empty() ? "" : ", ") + k;
        DMOE_FAIL_INPUT("{}/trainer_state.json: unknown key '{}', which dmoe does not read, so it would be ignored; "
                        "remove it (the keys of a saved state are {}; options such as the learning rate are given on "
                        "the command line, e.g. --lr)", o.resume_dir, key, allowed);
      }
    }
    // The loss of the checkpoint's step (states from before 2026-12-07 have none): the log's line of that step must
    // show it, or the log is another run's (resuming with it cut that run's lines past the step, G4 of the sixteenth
    // bad-input pass).
    // A wrong type (a string, null) skipped the log's check without a word (F4 of the eighteenth pass): refused, as
    // the other keys are. (A missing one is allowed; the log is then not cut, see trim_resumed_log.)
    DMOE_REQUIRE_INPUT(!state.contains("loss") || (state["loss"].is_number() &&
                                                   std::isfinite(state["loss"].get<double>())),
                       "{}/trainer_state.json: 'loss' must be a number, the loss of its step (found {})", o.resume_dir,
                       state.contains("loss") ? state["loss"].dump() : "");
    if (state.contains("loss")) checkpoint_loss = state["loss"].get<double>();
    // A key of the wrong type would end in nlohmann's type_error ("unexpected error"): named instead.
    DMOE_REQUIRE_INPUT(!state.contains("seed") || state["seed"].is_number_unsigned(),
                       "{}/trainer_state.json: 'seed' must be an integer >= 0 (found {})", o.resume_dir,
                       state.contains("seed") ? state["seed"].dump() : "");
    for (const char* key : {"batch", "seq", "steps"})
      DMOE_REQUIRE_INPUT(!state.contains(key) || state[key].is_number_integer(),
                         "{}/trainer_state.json: '{}' must be an integer (found {})", o.resume_dir, key,
                         state.contains(key) ? state[key].dump() : "");
    // lr, steps and data of another type skipped their notes below without a word.
    DMOE_REQUIRE_INPUT(!state.contains("lr") || state["lr"].is_number(), "{}/trainer_state.json: 'lr' must be a "
                       "number (found {})", o.resume_dir, state.contains("lr") ? state["lr"].dump() : "");
    DMOE_REQUIRE_INPUT(!state.contains("data") || state["data"].is_string(), "{}/trainer_state.json: 'data' must be "
                       "a path (found {})", o.resume_dir, state.contains("data") ? state["data"].dump() : "");
    DMOE_REQUIRE_INPUT(!state.contains("seed") || state["seed"].get<uint64_t>() == o.seed,
                 "--resume {}: the run used --seed {}, this one {} (the data order would differ)", o.resume_dir,
                 state["seed"].get<uint64_t>(), o.seed);
    for (const auto& [key, value] : {std::pair<const char*, int64_t>{"batch", o.batch}, {"seq", o.seq}})
      DMOE_REQUIRE_INPUT(!state.contains(key) || state[key].get<int64_t>() == value,
                   "--resume {}: the run used --{} {}, this one {} (the batches would differ from the saved run's)",
                   o.resume_dir, key, state[key].get<int64_t>(), value);
    // --lr and --steps shape the learning-rate schedule: a resumed run may change them (to train on with another
    // schedule), but it then no longer continues as the saved run would have, and it says so.
    if (state.contains("lr") && state["lr"].is_number() && state["lr"].get<double>() != o.lr)
      print(fmt::format("train: note: --lr {} replaces the saved run's {} (--resume {}): the run continues with the new "
                        "schedule, not as the uninterrupted run would", o.lr, state["lr"].get<double>(), o.resume_dir));
    // The rest of the run's settings (recorded since the twelfth bad-input pass; older states lack them): a resumed
    // run that left out, say, the saved run's --warmup 100 took the default 10 without a word, and one with another
    // --val-fraction trained on another part of the text and validated on other windows.
    for (const char* key : {"val_fraction", "warmup", "min_lr", "weight_decay", "beta1", "beta2", "clip"})
      DMOE_REQUIRE_INPUT(!state.contains(key) || state[key].is_number(), "{}/trainer_state.json: '{}' must be a number "
                         "(found {})", o.resume_dir, key, state.contains(key) ? state[key].dump() : "");
    if (state.contains("val_fraction") && state["val_fraction"].get<double>() != o.val_fraction)
      print(fmt::format("train: note: --val-fraction {} replaces the saved run's {} (--resume {}): the run continues "
                        "on another split of the text (other training bytes, other held-out windows: its val loss is "
                        "not comparable with the saved run's)", o.val_fraction, state["val_fraction"].get<double>(),
                        o.resume_dir));
    for (const auto& [key, option, value] : {std::tuple<const char*, const char*, double>{"warmup", "--warmup",
                                                                                         double(o.warmup)},
                                             {"min_lr", "--min-lr", effective_min_lr(o)},
                                             {"weight_decay", "--weight-decay", o.weight_decay},
                                             {"beta1", "--beta1", o.beta1}, {"beta2", "--beta2", o.beta2},
                                             {"clip", "--clip", o.clip}})
      if (state.contains(key) && state[key].get<double>() != value)
        print(fmt::format("train: note: {} {} replaces the saved run's {} (--resume {}){}: the run continues with the "
                          "new setting, not as the uninterrupted run would", option, value, state[key].get<double>(),
                          o.resume_dir, std::string(key) == "min_lr" && o.min_lr < 0 ? " (the default, --lr / 10)"
                                                                                      : ""));
    if (state.contains("steps") && state["steps"].is_number_integer() && state["steps"].get<int64_t>() != o.steps)
      print(fmt::format("train: note: --steps {} replaces the saved run's {} (--resume {}): the warm-up and cosine "
                        "schedule are those of {} steps, not of the saved run's", o.steps,
                        state["steps"].get<int64_t>(), o.resume_dir, o.steps));
    // Another --data continues the run on other text: said, as for --lr. The state records the absolute path (a relative
    // one, as earlier states hold, named another file from another directory: `--data ../data` from a subdirectory).
    // Since the sixteenth pass the state also records the text itself (its length and fingerprint): the same path
    // with other content (a file added to the folder, a file edited) is said, and another path to the same text is not.
    // Both or neither (states written before the twenty-fifth session have neither): a wrong type or a negative length
    // was skipped without a word (H10 of the seventeenth pass).
    DMOE_REQUIRE_INPUT(state.contains("data_bytes") == state.contains("data_fingerprint"), "{}/trainer_state.json has "
                       "'{}' without '{}': a checkpoint records both (the training text's length and fingerprint) or, "
                       "written before they were, neither", o.resume_dir,
                       state.contains("data_bytes") ? "data_bytes" : "data_fingerprint",
                       state.contains("data_bytes") ? "data_fingerprint" : "data_bytes");
    DMOE_REQUIRE_INPUT(!state.contains("data_bytes") || (state["data_bytes"].is_number_integer() &&
                                                         state["data_bytes"].get<int64_t>() >= 0),
                       "{}/trainer_state.json: 'data_bytes' must be an integer >= 0, the training text's length (found "
                       "{})", o.resume_dir, state.contains("data_bytes") ? state["data_bytes"].dump() : "");
    DMOE_REQUIRE_INPUT(!state.contains("data_fingerprint") || (state["data_fingerprint"].is_string() &&
                                                               state["data_fingerprint"].get<std::string>().size() == 16),
                       "{}/trainer_state.json: 'data_fingerprint' must be 16 hexadecimal digits (found {})",
                       o.resume_dir, state.contains("data_fingerprint") ? state["data_fingerprint"].dump() : "");
    const bool text_known = state.contains("data_bytes");
    const bool same_text = text_known && state["data_bytes"].get<int64_t>() == int64_t(corpus.size()) &&
                           state["data_fingerprint"].get<std::string>() == corpus_id;
    const std::string saved_data = state.contains("data") ? path_from_json(state["data"].get<std::string>()) : "";
    const bool same_path = !state.contains("data") || same_file(saved_data, o.data_path);
    if (!same_path && !same_text)
      print(fmt::format("train: note: --data {} is not the saved run's data ({}; --resume {}): the run "
                        "continues on other text", o.data_path, saved_data, o.resume_dir));
    else if (same_path && text_known && !same_text)
      print(fmt::format("train: note: --data {} has changed since the saved run ({}; --resume {}): the run continues "
                        "on other text, its training and held-out parts split elsewhere (its val loss is not "
                        "comparable with the saved run's)", o.data_path,
                        state["data_bytes"].get<int64_t>() == int64_t(corpus.size())
                            ? fmt::format("{} bytes then and now, other content", corpus.size())
                            : fmt::format("{} bytes then, {} now", state["data_bytes"].get<int64_t>(), corpus.size()),
                        o.resume_dir));
    // The weights' shapes are checked when they are read, but a model that differs in anything else (tied embeddings,
    // rope_theta, rms_norm_eps, ...) was resumed without a word: the saved config.json must be this run's model.
    const fs::path saved_config = fs::path(o.resume_dir) / "config.json";
    // dmoe writes it with every checkpoint: without it the comparison below was skipped without a word.
    // (The error_code form: a config.json that is a symbolic link loop threw filesystem_error, rc 2.)
    std::error_code config_ec;
    DMOE_REQUIRE_INPUT(fs::exists(saved_config, config_ec), "--resume {}: no config.json{}; a dmoe checkpoint holds "
                       "config.json, model.safetensors, optimizer.safetensors and trainer_state.json (the saved model is "
                       "compared with --config)", o.resume_dir, config_ec ? " (" + config_ec.message() + ")" : "");
    {
      const json saved = mixtral_config_to_json(load_mixtral_config(saved_config.string())),
                 now = mixtral_config_to_json(config);
      std::string differ;
      for (auto it = saved.begin(); it != saved.end(); ++it)
        // initializer_range has no effect on a resumed run; output_router_logits does (it adds the load-balancing loss).
        if (it.key() != "initializer_range" &&
            (!now.contains(it.key()) || now.at(it.key()) != it.value()))
          differ += fmt::format("{}{} {} (this run: {})", differ.empty() ? "" : ", ", it.key(), it.value().dump(),
                                now.contains(it.key()) ? now.at(it.key()).dump() : "none");
      DMOE_REQUIRE_INPUT(differ.empty(), "--resume {}: the saved run's model ({}) differs from this run's --config: "
                         "{}; resume with the saved config, or start a new run from its weights with --init {}",
                         o.resume_dir, saved_config.string(), differ,
                         (fs::path(o.resume_dir) / "model.safetensors").string());
    }
    const std::string model_path = (fs::path(o.resume_dir) / "model.safetensors").string();
    const CheckpointReader model = CheckpointReader::open(model_path);
    // dmoe saves the weights and the AdamW moments as F32 (the f32 masters, also with --dtype bf16). A file converted to
    // bf16/f16 by hand (its metadata kept) was read, converted back, and resumed with rc 0, on rounded values: not the
    // exact resume a checkpoint promises (G22A-13 of the twenty-second pass). --init still takes any float dtype.
    const auto require_saved_dtype = [&](const std::string& file, const std::string& name, const std::string& dtype) {
      DMOE_REQUIRE_INPUT(dtype == "F32", "--resume {}: {} holds tensor '{}' as {}, but dmoe saves a checkpoint's "
                         "weights and AdamW moments as F32: the file was converted, and its rounded values would not "
                         "continue the saved run exactly (a resume is bit for bit the run that was not interrupted); "
                         "resume from the files as dmoe saved them, or start a new run from these weights with --init "
                         "{}", o.resume_dir, file, name, dtype, model_path);
    };
    for (const std::string& name : model.names()) require_saved_dtype(model_path, name, model.dtype(name));
    full = load_mixtral_weights(model, config);
    const SafetensorsFile opt = SafetensorsFile::open((fs::path(o.resume_dir) / "optimizer.safetensors").string());
    for (const std::string& name : opt.names()) require_saved_dtype(opt.source(), name, opt.info(name).dtype);
    // The save renames its files one after another (trainer_state.json last): a kill between two renames leaves files
    // of two steps. Each file names its step (kStepMetadata); files of checkpoints from before that carry none.
    const int64_t state_step = state["step"].get<int64_t>();
    for (const auto& [file, meta] : {std::pair<std::string, std::map<std::string, std::string>>{model_path, model.metadata()},
                                     {opt.source(), opt.metadata()}}) {
      const auto it = meta.find(kStepMetadata);
      DMOE_REQUIRE_INPUT(it == meta.end() || it->second == std::to_string(state_step),
                         "--resume {}: {} was saved at step {}, trainer_state.json at step {}: the files are of two "
                         "different saves (one interrupted between its renames, or a file copied in from another checkpoint); resume from "
                         "another checkpoint{}",
                         o.resume_dir, file, it == meta.end() ? "" : it->second, state_step,
                         backups_beside(o.resume_dir));
    }
    // Files of one save carry its id (kSaveIdMetadata); checkpoints from before it carry none in any file. A file
    // with another id, or without one beside files that have one, was copied in from another checkpoint.
    DMOE_REQUIRE_INPUT(!state.contains("save_id") || state["save_id"].is_string(), "{}/trainer_state.json: 'save_id' "
                       "must be a string (found {})", o.resume_dir, state.contains("save_id") ? state["save_id"].dump() : "");
    const std::string state_id = state.contains("save_id") ? state["save_id"].get<std::string>() : "";
    const auto model_meta = model.metadata(), opt_meta = opt.metadata();
    const auto id_of = [](const std::map<std::string, std::string>& meta) {
      const auto it = meta.find(kSaveIdMetadata);
      return it == meta.end() ? std::string() : it->second;
    };
    const std::string model_id = id_of(model_meta), opt_id = id_of(opt_meta);
    if (!state_id.empty() || !model_id.empty() || !opt_id.empty()) {
      const auto said = [](const std::string& id) { return id.empty() ? std::string("none") : id; };
      DMOE_REQUIRE_INPUT(state_id == model_id && state_id == opt_id,
                         "--resume {}: the files are of different saves (save ids: trainer_state.json {}, "
                         "model.safetensors {}, optimizer.safetensors {}): a file was copied in from another "
                         "checkpoint, whose weights and AdamW moments do not belong together; resume from one save's "
                         "files, or start from a model with --init{}", o.resume_dir, said(state_id), said(model_id),
                         said(opt_id), backups_beside(o.resume_dir));
    }
    read_prefixed(opt, "exp_avg.", full_m, config, false);
    read_prefixed(opt, "exp_avg_sq.", full_v, config, true);
    // A tensor beside the moments (exp_avg.lm_head.bias, a moment of no parameter) resumed with rc 0 and no note
    // (G21-10): the model file refuses a tensor it does not read (G20-4), and so does the optimizer's.
    {
      std::set<std::string> moments;
      for (const ParamView& p : parameter_views(full_m, config)) {
        moments.insert("exp_avg." + p.name);
        moments.insert("exp_avg_sq." + p.name);
      }
      for (const std::string& name : opt.names())
        DMOE_REQUIRE_INPUT(moments.count(name), "--resume {}: {} holds tensor '{}', which is not an AdamW moment of "
                           "the model's parameters, so it would be ignored; remove it (the file holds exp_avg.NAME and "
                           "exp_avg_sq.NAME for each parameter NAME of model.safetensors, and nothing else)",
                           o.resume_dir, opt.source(), name);
    }
  } else if (o.init == "random") {
    full = random_mixtral_weights(config, o.seed);
  } else {
    full = load_mixtral_weights(CheckpointReader::open(o.init), config);
  }
  const int64_t last_step = o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps;
  // "(--stop-after 0)" was named here when --stop-after was not given (0 is its "not given" mark, refused as a value).
  if (o.stop_after > 0)
    DMOE_REQUIRE_INPUT(first_step <= last_step, "--resume {}: the saved run is at step {}, and --stop-after {} stops at "
                       "or before it: nothing to do; give a --stop-after past {} (up to --steps {}), or leave it out",
                       o.resume_dir, first_step - 1, o.stop_after, first_step - 1, o.steps);
  DMOE_REQUIRE_INPUT(first_step <= last_step, "--resume {}: the saved run is at step {}, and --steps {} ends there or "
                     "before: nothing to do; give --steps past {} to train further", o.resume_dir, first_step - 1,
                     o.steps, first_step - 1);

  // --schedule tuned: the run shape a tuning file belongs to, and whether one is reused.
  const json tune_key{{"model", config.summary()}, {"batch", o.batch}, {"seq", o.seq}, {"world", o.world},
                      {"dtype", dtype_name(o.dtype)}};
  // The file holds one entry per run shape ({"runs": [{"key", "samples", "choice"}, ...]}): a new shape is added,
  // never written over another's; a file that is not one of these is refused before the run, not replaced.
  std::optional<flow::TunePoint> tuned_choice;
  bool tuned_vanilla = false;  // the reused choice is the vanilla baseline (the graph of --schedule vanilla)
  json tune_runs = json::array();
  // The error_code form: a symbolic link loop as --tune-file threw filesystem_error ("unexpected error", rc 2); such a
  // path is refused as an output below, naming the loop.
  std::error_code tune_ec;
  if (tuned && !o.tune_file.empty() && fs::exists(o.tune_file, tune_ec)) {
    const json t = read_json_file(o.tune_file, "Flow tuning file");
    DMOE_REQUIRE_INPUT(t.is_object() && t.contains("runs") && t["runs"].is_array(), "--tune-file {}: not a Flow tuning "
                       "file (no \"runs\" list); it is left as it is: give a new path", o.tune_file);
    // The file is rewritten as {"runs": [...]}: anything else in it would be dropped without a word.
    for (auto it = t.begin(); it != t.end(); ++it)
      DMOE_REQUIRE_INPUT(it.key() == "runs", "--tune-file {}: unknown top-level key '{}' (a tuning file holds only "
                         "\"runs\"; rewriting it would drop the key): remove it or give a new path", o.tune_file,
                         it.key());
    tune_runs = t["runs"];
    for (const json& run : tune_runs) {
      if (!run.is_object() || !run.contains("key") || run["key"] != tune_key) continue;
      // Two entries for one shape (the tuner writes one): which to reuse would be a guess.
      DMOE_REQUIRE_INPUT(!tuned_choice, "--tune-file {}: two entries have this run's shape {}; keep one", o.tune_file,
                         tune_key.dump());
      const json& c = run.contains("choice") ? run["choice"] : json();
      DMOE_REQUIRE_INPUT(c.is_object() && c.contains("micro_batches") && c["micro_batches"].is_number_integer() &&
                             c.contains("chunk_bytes") && c["chunk_bytes"].is_number_integer(),
                         "--tune-file {}: the entry of this run's shape has no integer choice.micro_batches and "
                         "choice.chunk_bytes", o.tune_file);
      // Read as written (get<int32_t> would wrap 2^32 + 2 to 2); the rules of --micro-batches and --chunk-bytes.
      const std::string mb = c["micro_batches"].dump(), sp_text = c["chunk_bytes"].dump();
      const bool mb_ok = !c["micro_batches"].is_number_unsigned() || c["micro_batches"].get<uint64_t>() <= 4096;
      const bool sp_ok = !c["chunk_bytes"].is_number_unsigned() || c["chunk_bytes"].get<uint64_t>() <= (uint64_t(1) << 40);
      const int64_t r = mb_ok ? c["micro_batches"].get<int64_t>() : 0, sp = sp_ok ? c["chunk_bytes"].get<int64_t>() : 0;
      // One message per field (both were named whichever was wrong).
      DMOE_REQUIRE_INPUT(r >= 1 && (o.batch / o.world) % r == 0, "--tune-file {}: choice.micro_batches {} of this run's "
                         "shape must split the {} sequences per rank (--batch {} / --world {}); retune, or remove the "
                         "entry", o.tune_file, mb, o.batch / o.world, o.batch, o.world);
      DMOE_REQUIRE_INPUT(sp >= 4 && sp % 4 == 0 && sp <= (int64_t(1) << 40), "--tune-file {}: choice.chunk_bytes {} of "
                         "this run's shape must be a multiple of 4 in [4, 2^40]", o.tune_file, sp_text);
      // The step time is not used, but a negative or non-numeric one says the file is not what the tuner wrote.
      DMOE_REQUIRE_INPUT(!c.contains("step_ms") || (c["step_ms"].is_number() && std::isfinite(c["step_ms"].get<double>())
                                                    && c["step_ms"].get<double>() > 0),
                         "--tune-file {}: choice.step_ms {} of this run's shape must be a time in ms > 0", o.tune_file,
                         c.contains("step_ms") ? c["step_ms"].dump() : "");
      // "schedule": "vanilla" when the baseline won (files written before it existed hold chunked-ar choices only).
      bool vanilla = false;
      if (c.contains("schedule")) {
        DMOE_REQUIRE_INPUT(c["schedule"].is_string() && (c["schedule"] == "vanilla" || c["schedule"] == "chunked-ar"),
                           "--tune-file {}: choice.schedule {} of this run's shape; allowed: \"vanilla\", "
                           "\"chunked-ar\"", o.tune_file, c["schedule"].dump());
        vanilla = c["schedule"] == "vanilla";
        DMOE_REQUIRE_INPUT(!vanilla || r == 1, "--tune-file {}: choice.schedule \"vanilla\" with micro_batches {}; "
                           "the vanilla baseline runs R = 1", o.tune_file, mb);
      }
      flow::TunePoint p;
      p.micro_batches = int32_t(r);
      p.log2_chunk_bytes = std::log2(double(sp));
      tuned_choice = p;
      tuned_vanilla = vanilla;
    }
  }
  if (tuned && !tuned_choice) {
    // In 64 bits: --tune-steps 2147483647 wrapped tune_steps + 1 to a negative count, the check passed, and the whole run
    // stayed on the first sample without a word (rc 0, never tuned).
    const int64_t need = (int64_t(o.tune_samples) + 1) * (int64_t(o.tune_steps) + 1);
    DMOE_REQUIRE_INPUT(last_step - first_step + 1 >= need, "train: --schedule tuned samples the vanilla baseline, {} "
                       "point(s) (Sp, R) and the baseline again: {} x ({} timed + 1 warm-up) steps = {} steps, more "
                       "than the {} this run has; lower --tune-samples/--tune-steps or raise --steps",
                       o.tune_samples - 1, int64_t(o.tune_samples) + 1, o.tune_steps, need,
                       last_step - first_step + 1);
    if (!o.tune_file.empty()) {
      check_output_file(o.tune_file, "--tune-file");
      check_tune_lock_file(o);
    }
  }

  // One run at a time writes a log (LogLock, above), taken before the --save directory is made. Its lock file may be no
  // other path of the run (--save there was made a moment later as a directory and failed, "Not a directory", G23A-10;
  // --tune-file there was replaced by the tuning file).
  LogLock log_lock;
  const bool writes_log = !o.log_path.empty() && (o.engine != "cuda" || detect_process_env().rank == 0);
  if (writes_log) {
    const fs::path lock = lock_file_beside(o.log_path);
    for (const NamedPath& other : std::vector<NamedPath>{{"--save", o.save_dir}, {"--tune-file", o.tune_file},
                                                         {"--data", o.data_path}, {"--resume", o.resume_dir}})
      DMOE_REQUIRE_INPUT(other.path.empty() || !same_file(other.path, lock.string()), "{} '{}' is the lock file of "
                         "--log {} ('{}'), which dmoe makes beside the log while a run writes it and then removes: "
                         "give another {}", other.option, other.path, o.log_path, lock.string(), other.option);
    log_lock.take(o.log_path, "--log", print);
  }
  // One run at a time saves into a directory: two runs with the same --save both said "saved", the directory holding
  // whichever committed last (H12 of the seventeenth pass). The saving process holds an exclusive lock on the directory
  // (flock, released when it ends, however it ends); a second is refused before it trains.
  struct DirectoryLock {
    int fd = -1;
    ~DirectoryLock() {
      if (fd >= 0) ::close(fd);
    }
  } save_lock;
  if (!o.save_dir.empty() && (o.engine != "cuda" || detect_process_env().rank == 0)) {
    std::error_code ec;
    fs::create_directories(o.save_dir, ec);
    DMOE_REQUIRE_INPUT(!ec, "--save {}: the checkpoint directory cannot be made: {}", o.save_dir, ec.message());
    save_lock.fd = ::open(o.save_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DMOE_REQUIRE_INPUT(save_lock.fd >= 0, "--save {}: the checkpoint directory cannot be opened: {}", o.save_dir,
                       std::strerror(errno));
    for (int tries = 1; ::flock(save_lock.fd, LOCK_EX | LOCK_NB) != 0; ++tries) {
      const int err = errno;
      // The other ranks of this GPU job complete an interrupted save's journal under this lock, shared, for a moment
      // (complete_interrupted_save, G22A-2): waited for, up to 2 s, before another run is taken to hold it.
      if (err == EWOULDBLOCK && o.engine == "cuda" && tries < 20) {
        ::usleep(100000);
        continue;
      }
      DMOE_REQUIRE_INPUT(err != EWOULDBLOCK, "--save {}: another dmoe run is saving into this directory now (it holds "
                         "the directory's lock): wait for it to end, or give another --save", o.save_dir);
      break;  // A file system without flock (some network ones): no lock, as before.
    }
  }
  // The log grows line by line, each line checked (core/output_file.hpp, GrowingOutputFile). A new run's lines go to a
  // temporary of dmoe's own beside the log, which replaces the log when the run first saves a checkpoint (--save-every)
  // or ends: until then the earlier run's log stays as it was, beside the checkpoint it describes (it used to be
  // truncated at the start, so a run that failed lost it; then it was written as "<log>.partial", a name nobody
  // checked, which could be an input: `--data c.partial --log c` destroyed the text). A resumed run appends to the log
  // it continues, cut back first to the checkpoint's step (a run stopped after its last save logged steps past it).
  std::optional<GrowingOutputFile> log;
  // In a GPU job every process runs this with the same --log; rank 0 writes it (the others used to open and truncate it
  // too, racing rank 0's first lines).
  if (writes_log) {
    std::error_code ec;
    const bool append = first_step > 1 && fs::exists(o.log_path, ec);
    log.emplace(o.log_path, "--log", append);
    if (append)
      trim_resumed_log(*log, o.log_path, first_step - 1, checkpoint_loss,
                       (fs::path(o.resume_dir) / "trainer_state.json").string(), print);
  }
  print(fmt::format("train: {} | data {} ({} bytes: {} train, {} held out) | batch {} x seq {} | world {} | steps "
                    "{}..{} of {}", config.summary(), o.data_path, corpus.size(), train_bytes, val_bytes, o.batch,
                    o.seq, o.world, first_step, last_step, o.steps));

  TrainResult result;
  std::mutex mutex;
  const int64_t local = o.batch / o.world;
  const bool on_gpu = o.engine == "cuda";

  // Every rank's share into the full tensors (dense from rank 0): shared memory for threads, the communicator for GPU
  // processes; then rank 0 writes the checkpoint.
  double saved_step_loss = std::numeric_limits<double>::quiet_NaN();  // rank 0's loss of the step a save holds
  auto save = [&](int32_t rank, TrainReplica& replica, int64_t step, const std::string& dir) {
    // Ranks that are processes gather the experts to rank 0 through the communicator (gather_full); threads
    // copy their shares into the shared full tensors.
    if (o.world == 1 || !replica.gather_full(full, full_m, full_v)) {
      MixtralWeights w, m, v;
      replica.export_share(w, m, v);
      std::lock_guard<std::mutex> lock(mutex);
      auto gather = [&](MixtralWeights& mine, MixtralWeights& all) {
        std::vector<ParamView> a = parameter_views(all, config);
        size_t j = 0;
        for (const ParamView& p : parameter_views(mine, config)) {
          while (a[j].name != p.name) ++j;
          if (p.is_expert || rank == 0) std::copy(p.data, p.data + p.numel, a[j].data);
        }
      };
      gather(w, full);
      gather(m, full_m);
      gather(v, full_v);
    }
    replica.barrier();  // the threads' shares are all in `full`
    if (rank == 0 && !dir.empty()) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      DMOE_REQUIRE_INPUT(!ec, "--save {}: the checkpoint directory cannot be made: {}", dir, ec.message());
      // The four files together or not at all: each was renamed into place as soon as it was written, so a save that
      // failed or was interrupted part-way (a full disk, a scheduler's SIGTERM) left a checkpoint of two steps, e.g.
      // the new model beside the old trainer_state.json, which --resume then continued from the wrong step.
      OutputFileSet files;
      const std::string save_id = new_save_id();
      const std::map<std::string, std::string> tag = {{kStepMetadata, std::to_string(step)},
                                                      {kSaveIdMetadata, save_id}};
      files.write((fs::path(dir) / "model.safetensors").string(), mixtral_checkpoint_bytes(full, config, tag));
      files.write((fs::path(dir) / "config.json").string(), mixtral_config_to_json(config).dump(2) + "\n");
      {
        SafetensorsWriter opt;
        add_mixtral_tensors(opt, full_m, config, "exp_avg.");
        add_mixtral_tensors(opt, full_v, config, "exp_avg_sq.");
        opt.set_metadata(kStepMetadata, std::to_string(step));
        opt.set_metadata(kSaveIdMetadata, save_id);
        files.write((fs::path(dir) / "optimizer.safetensors").string(), opt.serialize());
      }
      json state{{"step", step}, {"seed", o.seed}, {"steps", o.steps}, {"batch", o.batch}, {"seq", o.seq},
                 {"lr", o.lr}, {"data", path_for_json(fs::absolute(o.data_path).lexically_normal().string())}, {"save_id", save_id},
                 {"data_bytes", int64_t(corpus.size())}, {"data_fingerprint", corpus_id},
                 {"val_fraction", o.val_fraction}, {"warmup", o.warmup}, {"min_lr", effective_min_lr(o)},
                 {"weight_decay", o.weight_decay}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"clip", o.clip}};
      // The log's line of this step shows it: a resume checks that its --log is this run's (trim_resumed_log).
      if (std::isfinite(saved_step_loss)) state["loss"] = saved_step_loss;
      files.write((fs::path(dir) / "trainer_state.json").string(), state.dump(2) + "\n");
      // A new run's log is published with its first checkpoint, as the last of the commit's renames and in its journal:
      // from now on the log describes this run, whose checkpoint this is. (Published after the commit, a kill between
      // the two left the checkpoint completed on resume beside the earlier run's log: H6 of the seventeenth pass.)
      files.commit((fs::path(dir) / kCheckpointJournal).string(), log ? &*log : nullptr);
    }
    replica.barrier();  // no rank goes on (e.g. to resume from the checkpoint) before it is written
  };

  // One rank's loop, on either engine (train_replica.hpp).
  auto run_rank = [&](int32_t rank, TrainReplica& replica) {
    const int64_t micro = local / o.micro_batches;
    // This rank's task graph: --schedule tuned replaces it as it samples, and thread ranks must not share that.
    std::optional<flow::TaskGraph> graph = flow_graph;
    // A step's FLOP over all ranks (3 × forward, MixtralConfig::forward_flop) and the ceiling the MFU is against
    // (the GPU's bf16 GEMM timed by the replica; none on the CPU). Ranks sharing one GPU overstate it.
    const double step_flop = 3 * config.forward_flop(o.batch, o.seq);
    const double ceiling = replica.gemm_ceiling_flop_per_s();

    auto validate = [&] {
      double sum = 0;
      int64_t windows = 0;
      for (int64_t w0 = 0; w0 + o.batch <= val_windows; w0 += o.batch) {
        sum += replica.evaluate(val_tokens.data() + (w0 + rank * local) * o.seq, local, o.seq);
        ++windows;
      }
      return sum / double(windows);  // each forward's loss is already the mean over all ranks
    };

    // --schedule tuned (flow/tuner.hpp): each sample runs one warm-up step and tune_steps timed steps; rank 0's mean
    // wall time of the Flow step is every rank's observation, so every rank's tuner suggests the same next point. The
    // first sample is the vanilla baseline (the graph of --schedule vanilla: R = 1, the all-reduce after the
    // backward), the other tune_samples − 1 are chunked-ar at the tuner's (Sp, R), starting at R = 1 and 1 MiB, and
    // one more sample takes the baseline again, last: a run's first steps are slower than its later ones (at W = 2
    // ranks on an H100 the baseline's first sample was 29 ms per Flow step where `flow measure` gives 13.6, the tuner
    // chose chunked-ar at 20 ms, and the run went 8 % slower than vanilla; twenty-fifth session), so the baseline is
    // the faster of its two samples. The choice is the fastest of all of them, so a tuned run is never slower than
    // vanilla by more than the samples' noise (issue 15's "never more than 2 % slower once tuned"), even where every
    // chunking costs more than it hides.
    std::optional<flow::FlowTuner> tuner;
    flow::TunePoint point;
    bool point_vanilla = false;  // the current graph is the vanilla baseline, not chunked-ar at `point`
    std::optional<double> vanilla_ms;  // the baseline's sample, once taken
    int32_t samples_taken = 0;
    std::vector<double> sample_ms;
    int32_t sample_step = 0;
    json samples = json::array();
    std::string schedule_text = o.schedule;
    auto use_point = [&](const flow::TunePoint& p, bool vanilla) {
      point = p;
      point_vanilla = vanilla;
      graph = vanilla ? make_graph(flow::Schedule::vanilla, 1, p.chunk_bytes())
                      : make_graph(flow::Schedule::chunked_ar, p.micro_batches, p.chunk_bytes());
      sample_ms.clear();
      sample_step = 0;
    };
    auto describe = [](const flow::TunePoint& p, bool vanilla) {
      if (vanilla) return std::string("vanilla (R = 1, the all-reduce after the backward)");
      return fmt::format("R = {}, Sp = {:.1f} KiB", p.micro_batches, (p.chunk_bytes() / 4 * 4) / 1024.0);
    };
    flow::TunePoint first;  // the tuner's first point, and the baseline's R (its Sp is not used)
    first.micro_batches = 1;
    first.log2_chunk_bytes = 20;
    if (tuned && tuned_choice) {
      use_point(*tuned_choice, tuned_vanilla);
      schedule_text = "tuned (" + describe(point, point_vanilla) + ", reused from " + o.tune_file + ")";
      if (rank == 0) print(fmt::format("tuned: reusing {} from {}", describe(point, point_vanilla), o.tune_file));
    } else if (tuned) {
      flow::TunerOptions to;
      to.seed = o.seed;
      to.micro_batches.clear();
      for (int32_t r : {1, 2, 4, 8})
        if (local % r == 0) to.micro_batches.push_back(r);
      tuner.emplace(to);
      use_point(first, true);
    }

    // Peak memory and energy over the training steps (core/resource_probe.hpp), read by rank 0 (this process
    // holds every thread rank of the CPU engine; on GPUs, rank 0's process and its GPU).
    std::optional<ResourceProbe> probe;
    std::optional<ResourceReport> resources;
    if (rank == 0) {
      ResourceProbeOptions po;
      po.scope = on_gpu ? (o.world > 1 ? "rank 0's process" : "this process")
                        : fmt::format("this process (all {} thread ranks)", o.world);
      if (on_gpu) {
        const char* shared = std::getenv("DMOE_SHARED_GPUS");
        probe_current_cuda_device(po, o.world == 1 ? "one rank"
                                      : shared && std::string(shared) == "1"
                                          ? fmt::format("the job's {} ranks share it (MPS)", o.world)
                                          : "rank 0's GPU: the other ranks' GPUs are not read");
      }
      probe.emplace(po);
    }
    double previous_lr = 0, previous_grad_norm = 0;  // the last update's, for a divergence's error
    int64_t step = first_step;
    // Weights made non-finite by the step before are found by a check deep in the model ("router_topk: token 1 has no
    // valid choice 1; its logits contain NaN"), which named neither the step nor the options behind it.
    const auto diverged_is_said = [&](const auto& step_math) {
      try {
        return step_math();
      } catch (const Error& e) {
        const std::string what = e.what();
        const bool non_finite = what.find("NaN") != std::string::npos || what.find("not finite") != std::string::npos ||
                                what.find("non-finite") != std::string::npos;
        if (!e.is_input() || !non_finite || step == first_step) throw;
        throw Error(fmt::format("train: step {}: non-finite values in the model after step {} (lr {:.3g}, grad norm "
                                "{:.4g} before clipping): the training diverged; lower --lr, or keep --clip and "
                                "--warmup on. The check that saw it: {}", step, step - 1, previous_lr,
                                previous_grad_norm, what), ErrorKind::input);
      }
    };
    for (; step <= last_step; ++step) {
      if (probe && step == first_step) probe->start();
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<int32_t> tokens = train_batch(step);
      replica.zero_grads();
      double loss = 0;
      if (graph) {  // forwards, backwards and the all-reduce as one task graph (docs/flow.md)
        const auto f0 = std::chrono::steady_clock::now();
        loss = diverged_is_said(
            [&] { return replica.flow_step(*graph, tokens.data() + rank * local * o.seq, local, o.seq); });
        if (tuner) {  // still sampling
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - f0).count();
          if (sample_step++ > 0) sample_ms.push_back(ms);  // the first step at a point is its warm-up
          if (int32_t(sample_ms.size()) == o.tune_steps) {
            double mean = 0;
            for (double v : sample_ms) mean += v / double(sample_ms.size());
            mean = replica.rank0_value(mean);
            ++samples_taken;
            const int32_t all_samples = o.tune_samples + 1;  // the baseline's second sample last
            if (point_vanilla) {
              vanilla_ms = vanilla_ms ? std::min(*vanilla_ms, mean) : mean;
              samples.push_back({{"schedule", "vanilla"}, {"micro_batches", 1}, {"step_ms", mean}});
            } else {
              tuner->observe(point, mean);
              samples.push_back({{"schedule", "chunked-ar"}, {"micro_batches", point.micro_batches},
                                 {"chunk_bytes", point.chunk_bytes() / 4 * 4}, {"step_ms", mean}});
            }
            if (rank == 0 && o.print_every > 0)
              print(fmt::format("tuned: sample {}/{}: {}{}: {:.3f} ms per Flow step", samples_taken, all_samples,
                                describe(point, point_vanilla), samples_taken == all_samples ? ", again" : "", mean));
            if (samples_taken == all_samples) {
              // The baseline wins ties: it is the simpler schedule.
              const bool vanilla = *vanilla_ms <= tuner->best_value();
              const flow::TunePoint best = vanilla ? first : tuner->best();
              const double best_ms = vanilla ? *vanilla_ms : tuner->best_value();
              use_point(best, vanilla);
              tuner.reset();
              schedule_text = "tuned (" + describe(point, point_vanilla) + ")";
              if (rank == 0) {
                print(fmt::format("tuned: chose {} ({:.3f} ms per Flow step; vanilla {:.3f}) for the rest of the run",
                                  describe(best, vanilla), best_ms, *vanilla_ms));
                if (!o.tune_file.empty()) {
                  add_tune_entry(o.tune_file, tune_key,
                                 json{{"key", tune_key}, {"samples", samples},
                                      {"choice", {{"schedule", vanilla ? "vanilla" : "chunked-ar"},
                                                  {"micro_batches", best.micro_batches},
                                                  {"chunk_bytes", best.chunk_bytes() / 4 * 4},
                                                  {"step_ms", best_ms}}}},
                                 print);
                }
              }
            } else if (samples_taken == all_samples - 1) {
              use_point(first, true);  // the baseline again
            } else {
              use_point(point_vanilla ? first : tuner->suggest(), false);
            }
          }
        }
      } else {
        loss = diverged_is_said([&] {
          double sum = 0;
          for (int32_t r = 0; r < o.micro_batches; ++r)
            sum += replica.forward(tokens.data() + (rank * local + r * micro) * o.seq, micro, o.seq, r) /
                   o.micro_batches;
          for (int32_t r = o.micro_batches - 1; r >= 0; --r) replica.backward(r, 1.0 / o.micro_batches);
          replica.reduce_grads();
          return sum;
        });
      }
      // Global norm: replicated tensors once (equal on all ranks), experts summed over ranks.
      double sq[2] = {0, 0};  // replicated, experts (over all ranks)
      replica.grad_sum_of_squares(sq);
      const double total_sq = sq[0] + sq[1];
      const double scale = cpu::clip_coefficient(total_sq, o.clip);
      cpu::AdamWParams ap;
      ap.lr = scheduled_lr(o, step);
      ap.beta1 = o.beta1;
      ap.beta2 = o.beta2;
      ap.eps = o.eps;
      ap.step = step;
      replica.adamw_step(ap, o.weight_decay, scale);
      previous_lr = ap.lr, previous_grad_norm = std::sqrt(total_sq);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

      TrainRecord rec;
      rec.step = step;
      rec.loss = loss;
      if (rank == 0) saved_step_loss = loss;
      rec.lr = ap.lr;
      rec.grad_norm = std::sqrt(total_sq);
      rec.tokens_per_s = double(o.batch * o.seq) / std::max(seconds, 1e-9);
      const bool do_val = step == last_step || (o.val_every > 0 && step % o.val_every == 0);
      if (do_val) rec.val_loss = validate();
      // Saved after the step's line is in the log: the save publishes a new run's log with the checkpoint, and a resume
      // finds the checkpoint's step there (trim_resumed_log checks its loss). Saved first, a --save-every checkpoint's
      // step had no line in the log it published, nor in the log of a run killed right after that save.
      const bool save_now = o.save_every > 0 && step % o.save_every == 0 && step != last_step;
      if (rank != 0) {
        if (save_now) save(rank, replica, step, o.save_dir);  // collective: every rank calls it once
        continue;
      }
      if (step == last_step) resources = probe->finish(last_step - first_step + 1);  // validation included
      result.records.push_back(rec);
      if (log) {
        json line{{"step", step}, {"loss", loss}, {"lr", ap.lr}, {"grad_norm", rec.grad_norm},
                  {"tokens_per_s", rec.tokens_per_s}, {"tflop_per_s", step_flop / seconds * 1e-12}};
        if (ceiling > 0) line["mfu"] = step_flop / seconds / (ceiling * o.world);
        if (resources) line["resources"] = resources->to_json();  // the last step's record
        log->write(line.dump() + "\n" +
                   (do_val ? json{{"step", step}, {"val_loss", rec.val_loss}}.dump() + "\n" : std::string()),
                   fmt::format("step {}", step));
      }
      if (o.print_every > 0 && (step % o.print_every == 0 || step == last_step || do_val))
        print(fmt::format("step {:>5}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} tokens/s | {:.3g} "
                          "TFLOP/s{}{}", step, o.steps, loss, ap.lr, rec.grad_norm, rec.tokens_per_s, step_flop / seconds * 1e-12,
                          ceiling > 0 ? fmt::format(" | MFU {:.1f}%", 100 * step_flop / seconds / (ceiling * o.world))
                                      : std::string(),
                          do_val ? fmt::format(" | val loss {:.4f}", rec.val_loss) : std::string()));
      if (save_now) save(rank, replica, step, o.save_dir);
    }
    save(rank, replica, last_step, o.save_dir);
    if (resources && o.print_every > 0) {
      std::string text = fmt::format("resources over the {} training steps (steps {}..{}, validation included; read by "
                                     "rank 0 after its last step):", resources->steps, first_step, last_step);
      for (const std::string& l : resources->lines()) text += "\n  " + l;
      print(text);
    }
    const auto stages = replica.stage_times();
    const TrainReplica::FlowTimes flow_times = replica.flow_times();
    if (rank == 0 && flow_times.steps > 0 && o.print_every > 0) {
      // Per task kind, not per stage: the executor's streams overlap, so these add up to more than the step.
      const double n = double(flow_times.steps);
      std::string table = fmt::format(
          "Flow executor (--schedule {}, R = {} micro-batches): time per task kind, ms per step over its last {} steps "
          "(the graph's first step left out: it builds the engines; {}; "
          "the streams overlap, so the kinds add up to more than the step; the tasks span {:.2f} ms per step; "
          "the AR chunks cover every replicated gradient, the head's and the embedding's included; on the GPU the C' "
          "preludes (head, combine backward) are in no task (the CPU executor runs them inside C'); a collective's "
          "time includes waiting for its peers):",
          schedule_text, tuned ? point.micro_batches : o.micro_batches, flow_times.steps, flow_times.clock,
          flow_times.span_ms / n);
      for (const auto& [name, ms] : flow_times.kinds) table += fmt::format("\n  {:<64} {:9.2f}", name, ms / n);
      print(table);
    }
    if (rank == 0 && !stages.empty() && o.print_every > 0) {
      const double steps = double(last_step - first_step + 1);
      double total = 0;
      for (const auto& st : stages) total += st.second;
      std::string table = fmt::format("time per stage{} (ms per step over {} steps, validation included; sum {:.2f}):",
                                      flow_times.steps > 0 ? " outside the Flow executor" : "",
                                      last_step - first_step + 1, total / steps);
      for (const auto& [name, ms] : stages)
        table += fmt::format("\n  {:<46} {:9.2f} {:6.1f}%", name, ms / steps, 100 * ms / std::max(total, 1e-9));
      print(table);
    }
  };

  if (on_gpu) {
    int32_t rank = 0, job_world = 1;
    cuda_job_size(&rank, &job_world);
    DMOE_REQUIRE_INPUT(job_world == o.world, "train: --world {} but this GPU job has {} ranks (dmoe launch -n W, "
                       "mpirun -n W); give --world {} or start W processes", o.world, job_world, job_world);
    std::unique_ptr<TrainReplica> replica =
        make_cuda_replica(config, o.dtype, full, full_m, full_v, o.micro_batches,
                          local * o.seq,  // validation runs a rank's whole share in one forward
                          bf16_expert_grads_for_training(config, o.dtype, o.micro_batches, !o.schedule.empty(),
                                                         cuda_grouped_bf16_wgrad()) &&
                              !o.f32_expert_grads);
    result.bf16_expert_grads = replica->bf16_expert_grads();
    // Said, as it changes the numbers (each expert gradient rounded once to bf16) and the memory.
    if (rank == 0 && result.bf16_expert_grads)
      print("train: the experts' gradients are kept in bf16 (one micro-batch, no --schedule, stored by the grouped sm90 "
            "kernel or hidden x ffn >= 2^21: half their memory, and the optimizer reads half the bytes); "
            "--f32-expert-grads keeps them f32");
    run_rank(rank, *replica);
  } else {
    // --schedule: the Flow executor's gradient chunks go on a second group of the same thread ranks (docs/flow.md:
    // the all-reduce on its own communicator is what makes the dynamic priority rule deadlock-free).
    std::vector<std::unique_ptr<Comm>> ar_comms;
    if (!o.schedule.empty()) ar_comms = make_thread_comms(o.world);
    run_thread_ranks(o.world, [&](int32_t rank, Comm& comm) {
      const int32_t per = config.num_local_experts / o.world, first = rank * per;
      std::unique_ptr<TrainReplica> replica =
          make_cpu_replica(config, comm, slice_mixtral_experts(full, first, per), slice_mixtral_experts(full_m, first, per),
                           slice_mixtral_experts(full_v, first, per), o.micro_batches,
                           ar_comms.empty() ? nullptr : ar_comms[size_t(rank)].get());
      run_rank(rank, *replica);
    });
  }
  if (log) {
    log->publish();
    log->close();
  }
  result.weights = full;
  if (!result.records.empty()) result.final_val_loss = result.records.back().val_loss;
  return result;
}

}  // namespace dmoe
