// output_file.cpp — see output_file.hpp for the policy.
#include "core/output_file.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "core/error.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

// The temporaries that exist now, for the handler of the terminating signals below: a fixed table, so that the handler
// only reads it and calls unlink (both async-signal-safe). An interrupted write (Ctrl-C, a scheduler's SIGTERM) left
// its ".NAME.dmoe-tmp.PID.N" behind; now it is removed and the process then ends by the signal as before.
// State: 0 free, 1 being filled, 2 a temporary that exists.
struct TemporarySlot {
  std::atomic<int> state{0};
  char path[PATH_MAX];
};
TemporarySlot g_temporaries[64];
}  // namespace

// Every signal whose default action ends the process and that is sent to a job from outside, not raised by a fault in
// it: Ctrl-C, Ctrl-\ (QUIT), kill and schedulers (TERM, HUP; Slurm --signal and `timeout -s` send USR1/USR2 too), a
// CPU-time limit (XCPU: ulimit -t, a batch system's time limit), timers (ALRM, VTALRM, PROF), a file-size limit (XFSZ:
// the dmoe tool ignores it, so a write fails with EFBIG instead, and an ignored signal gets no handler) and a closed
// output pipe (PIPE: `dmoe train | head -1`). Only INT, TERM and HUP were handled: a CPU-time limit or a USR1 left the
// run's whole log in its hidden temporary, and could end a commit between two renames (G20-6, twentieth pass). The
// faults (SEGV, BUS, ILL, FPE, ABRT, TRAP, SYS) stay as they are: a process in that state should not go on to run
// code, and their core dump shows where it was.
// SIGSTKFLT, SIGIO (SIGPOLL) and SIGPWR end a process by default too, and `kill -STKFLT`/`kill -IO` left the run's log
// in its temporary (G21-6, twenty-first pass); so do the real-time signals SIGRTMIN..SIGRTMAX (no library dmoe uses
// relies on one at its default disposition, and one that installs its own handler is left alone, below). SIGSYS stays
// out: a seccomp filter raises it for a forbidden system call, a fault of the process like SEGV.
const std::vector<int>& cleaned_signals() {
  static const std::vector<int> signals = [] {
    std::vector<int> s = {SIGINT,  SIGTERM,   SIGHUP,  SIGQUIT, SIGUSR1, SIGUSR2,   SIGALRM, SIGVTALRM,
                          SIGPROF, SIGXCPU,   SIGXFSZ, SIGPIPE, SIGIO,   SIGPWR};
#ifdef SIGSTKFLT
    s.push_back(SIGSTKFLT);
#endif
    for (int sig = SIGRTMIN; sig <= SIGRTMAX; ++sig) s.push_back(sig);
    return s;
  }();
  return signals;
}

namespace {

// While a set's renames run (OutputFileSet::commit), any of those signals is held back: ending between two renames
// left a checkpoint of mixed steps (the model of step 56 with the moments of step 55: the earlier, good checkpoint
// replaced file by file) or a sharded model of two seeds under one index. The handler records the signal; commit ends
// the process by it once every file is in place. (SIGKILL cannot be held back; a resume refuses such a mix by its
// save id.)
std::atomic<int> g_committing{0};
std::atomic<int> g_pending_signal{0};
void (*g_after_rename_for_tests)(size_t) = nullptr;

extern "C" void remove_temporaries_and_reraise(int sig) {
  if (g_committing.load() > 0) {
    int none = 0;
    g_pending_signal.compare_exchange_strong(none, sig);
    return;
  }
  const int saved_errno = errno;
  for (TemporarySlot& slot : g_temporaries)
    if (slot.state.load() == 2) ::unlink(slot.path);
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(sig, &fallback, nullptr);
  errno = saved_errno;
  ::raise(sig);  // the default action: the exit status says the signal, as without the handler
}

// Installed once, for the signals whose disposition is the default: one that is ignored (nohup, a background job of a
// shell) or handled by someone else (dmoe launch forwards them) is left alone.
void install_cleanup_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::vector<int>& cleaned = cleaned_signals();
    for (const int sig : cleaned) {
      struct sigaction previous {};
      if (::sigaction(sig, nullptr, &previous) != 0 || previous.sa_handler != SIG_DFL ||
          (previous.sa_flags & SA_SIGINFO))
        continue;
      struct sigaction action {};
      action.sa_handler = remove_temporaries_and_reraise;
      action.sa_flags = SA_RESTART;  // a signal held back during a commit must not fail another thread's read or write
      sigemptyset(&action.sa_mask);
      for (const int other : cleaned) sigaddset(&action.sa_mask, other);
      ::sigaction(sig, &action, nullptr);
    }
  });
}

// Records a temporary for the handler; returns its slot, or -1 when the table is full or the path too long (then a
// signal may leave that one behind, as before).
int register_temporary(const std::string& path) {
  install_cleanup_handlers();
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < int(std::size(g_temporaries)); ++i) {
    int expected = 0;
    if (!g_temporaries[i].state.compare_exchange_strong(expected, 1)) continue;
    std::memcpy(g_temporaries[i].path, path.c_str(), path.size() + 1);
    g_temporaries[i].state.store(2);
    return i;
  }
  return -1;
}

void release_temporary(int slot) {
  if (slot >= 0) g_temporaries[slot].state.store(0);
}

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

constexpr const char* kAllowed = "outputs must be regular files (replaced atomically), new files in an existing "
                                 "directory, or symbolic links to a regular file";

// Where the bytes will land: `path` itself or, for a symlink, its resolved target.
struct OutputTarget {
  std::string path;       // the file to replace or create
  std::string directory;  // its directory (for the temporary)
  std::string name;       // its file name
  bool exists = false;
  mode_t mode = 0;        // permission bits of the existing file
};

OutputTarget resolve_output(const std::string& path, std::string_view option) {
  const std::string what = option.empty() ? fmt::format("output '{}'", path) : fmt::format("{} '{}'", option, path);
  DMOE_REQUIRE_INPUT(!path.empty(), "{}: the output path is empty", what);
  // `--json -` wrote a file named "-" (not the standard output), `--out --` a file named "--": a name that reads as an
  // option or as stdout is refused; ./-name writes a file of that name.
  DMOE_REQUIRE_INPUT(path[0] != '-', "{}: a path that starts with '-' reads as an option{}; outputs are files: give "
                     "./{} for a file of that name", what, path == "-" ? " or as the standard output (not supported)"
                                                                      : "", path);
  OutputTarget t;
  t.path = path;
  struct stat ls {};
  if (::lstat(path.c_str(), &ls) == 0 && S_ISLNK(ls.st_mode)) {
    char* real = ::realpath(path.c_str(), nullptr);
    if (!real) {
      const int err = errno;
      // /dev/stdout, /proc/self/fd/N: a link to an open pipe, socket or deleted file has a target ("pipe:[123]")
      // that is no path, so realpath fails; stat still reaches the file it stands for. Say what that is.
      struct stat via {};
      if (::stat(path.c_str(), &via) == 0) {
        // The last link's target: /dev/stdout -> /proc/self/fd/1 -> "pipe:[123]".
        std::string shown = "?", hop = path;
        for (int i = 0; i < 40; ++i) {
          char target[PATH_MAX + 1] = {};
          const ssize_t n = ::readlink(hop.c_str(), target, PATH_MAX);
          if (n <= 0) break;
          shown = std::string(target, size_t(n));
          const fs::path next = fs::path(shown).is_absolute() ? fs::path(shown) : fs::path(hop).parent_path() / shown;
          struct stat hs {};
          if (::lstat(next.c_str(), &hs) != 0 || !S_ISLNK(hs.st_mode)) break;
          hop = next.string();
        }
        DMOE_FAIL_INPUT("{} is a symbolic link to {} ('{}'{}); dmoe writes each output to a temporary file beside it "
                        "and renames it into place, which a pipe, socket or terminal cannot take: give a file path "
                        "(e.g. --output y.safetensors, then read or copy that file); {}",
                        what, S_ISREG(via.st_mode) ? "a file that has no name (deleted, or open only)"
                                                   : file_kind(via.st_mode),
                        shown, path.rfind("/dev/std", 0) == 0 || path.rfind("/dev/fd/", 0) == 0 || path.rfind("/proc/", 0) == 0
                                   ? ": an open file descriptor, such as standard output into a pipe" : "",
                        kAllowed);
      }
      DMOE_FAIL_INPUT("{} is a symbolic link whose target cannot be resolved ({}); {}", what, std::strerror(err),
                      kAllowed);
    }
    t.path = real;
    std::free(real);
  }
  struct stat st {};
  if (::stat(t.path.c_str(), &st) == 0) {
    DMOE_REQUIRE_INPUT(S_ISREG(st.st_mode), "{} is {}; {}", what, file_kind(st.st_mode), kAllowed);
    // `--log /dev/stdout >> hist.txt` (or `--json out.txt > out.txt`): the output is the file this process's standard
    // output or error goes to. The rename replaced it, so the earlier content of hist.txt was gone and the run's own
    // lines went to the replaced file.
    for (const auto& [fd, stream] : {std::pair<int, const char*>{1, "standard output"}, {2, "standard error"}}) {
      struct stat open {};
      DMOE_REQUIRE_INPUT(!(::fstat(fd, &open) == 0 && S_ISREG(open.st_mode) && open.st_dev == st.st_dev &&
                           open.st_ino == st.st_ino),
                         "{} is the file this process's {} is redirected to ('{}'): the output would replace it, "
                         "its earlier content and the lines printed into it gone; give the output another file",
                         what, stream, t.path);
    }
    t.exists = true;
    t.mode = st.st_mode & 07777;
  } else if (errno == ENOTDIR) {
    // "a.txt/y.st": name the part of the path that is a file, not the directory it would have to be.
    fs::path part;
    std::string blocker;
    for (const fs::path& piece : fs::path(t.path).parent_path()) {
      part /= piece;
      struct stat ps {};
      if (::stat(part.c_str(), &ps) == 0 && !S_ISDIR(ps.st_mode)) {
        blocker = fmt::format("'{}' is {}, not a directory", part.string(), file_kind(ps.st_mode));
        break;
      }
    }
    DMOE_FAIL_INPUT("{}: {}; an output must be a file in an existing directory", what,
                    blocker.empty() ? std::string("a part of the path is not a directory") : blocker);
  } else {
    // A path past PATH_MAX (or with a part past NAME_MAX) was "cannot inspect it: File name too long": say which limit.
    if (errno == ENAMETOOLONG) {
      size_t longest = 0;
      for (const fs::path& piece : fs::path(t.path)) longest = std::max(longest, piece.native().size());
      DMOE_REQUIRE_INPUT(t.path.size() < size_t(PATH_MAX), "{}: the path is too long: {} bytes, past the limit of {} "
                         "bytes on a path (PATH_MAX); give a shorter path", what, t.path.size(), PATH_MAX - 1);
      DMOE_FAIL_INPUT("{}: a part of the path is too long: {} bytes, past the limit of {} bytes on a file name "
                      "(NAME_MAX)", what, longest, NAME_MAX);
    }
    DMOE_REQUIRE_INPUT(errno == ENOENT, "{}: cannot inspect it: {}", what, std::strerror(errno));
  }
  const fs::path p(t.path);
  DMOE_REQUIRE_INPUT(p.has_filename(), "{} names a directory, not a file; {}", what, kAllowed);
  t.name = p.filename().string();
  t.directory = p.has_parent_path() ? p.parent_path().string() : std::string(".");
  if (!t.exists) {
    struct stat ds {};
    DMOE_REQUIRE_INPUT(::stat(t.directory.c_str(), &ds) == 0, "{}: its directory '{}' does not exist or cannot be read: {}",
                       what, t.directory, std::strerror(errno));
    DMOE_REQUIRE_INPUT(S_ISDIR(ds.st_mode), "{}: '{}' is not a directory", what, t.directory);
  }
  return t;
}

// Creates a new temporary file next to the target; returns its descriptor and sets `tmp` to its path.
// `slot` (when given) receives the temporary's entry for the signal handler (release_temporary once it is gone).
int create_temporary(const OutputTarget& t, std::string& tmp, std::string_view what, int* slot = nullptr) {
  static std::atomic<unsigned> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    // ".NAME.dmoe-tmp.PID.N", with NAME cut short where the whole would pass NAME_MAX (255 bytes): a long but
    // valid output name was refused as "File name too long", which the user's name was not.
    // NAME is cut short too where the temporary's whole path would pass PATH_MAX: an output path of 4076-4095 bytes,
    // valid itself, was refused as "cannot create a temporary file in DIR: File name too long", the name blamed.
    const std::string suffix = fmt::format(".dmoe-tmp.{}.{}", ::getpid(), counter++);
    const std::string prefix = (fs::path(t.directory) / ".").string();  // "DIR/."
    const size_t fixed = prefix.size() + suffix.size();
    DMOE_REQUIRE_INPUT(fixed + 1 < size_t(PATH_MAX),
                       "{}: the path is too long: {} bytes, and its directory's {}; dmoe writes an output through a "
                       "temporary file beside it, whose path (at least {} bytes) would pass the limit of {} bytes on "
                       "a path (PATH_MAX): give a shorter path (a relative one counts only its own bytes)", what,
                       t.path.size(), t.directory.size(), fixed + 1, PATH_MAX - 1);
    std::string name = prefix;
    name.append(t.name, 0, std::min({t.name.size(), size_t(NAME_MAX) - 1 - suffix.size(), size_t(PATH_MAX) - 1 - fixed}));
    name += suffix;
    tmp = std::move(name);
    // Registered before it is created: a signal between the open and a later registration left it behind. A
    // signal before the open unlinks a name that does not exist yet, or (EEXIST) a stale dmoe temporary of a
    // process with the same PID.
    const int entry = slot ? register_temporary(tmp) : -1;
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      if (slot) *slot = entry;
      return fd;
    }
    const int open_errno = errno;
    release_temporary(entry);
    // Out of inodes, not of bytes (a tmpfs's nr_inodes, many small files): "No space left on device" sent the user to
    // df -h, which showed space free (G20-5, twentieth pass).
    struct statvfs v {};
    DMOE_REQUIRE_INPUT(!(open_errno == ENOSPC && ::statvfs(t.directory.c_str(), &v) == 0 && v.f_files > 0 &&
                         (v.f_favail == 0 || v.f_ffree == 0) && v.f_bavail > 0),
                       "{}: cannot create a temporary file in '{}': no free inodes (its file system can hold no more "
                       "files, though space is free: df -i '{}'); remove files there or write elsewhere", what,
                       t.directory, t.directory);
    errno = open_errno;
    DMOE_REQUIRE_INPUT(errno == EEXIST || errno == EINTR, "{}: cannot create a temporary file in '{}': {}", what,
                       t.directory, std::strerror(errno));
  }
  DMOE_FAIL_INPUT("{}: cannot create a temporary file in '{}': 100 names taken", what, t.directory);
}

// True where this process has CAP_FOWNER (root, as a rule), which lets rename(2) replace a file in a sticky directory
// that neither it nor the directory belongs to.
bool has_cap_fowner() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("CapEff:", 0) == 0) return (std::strtoull(line.c_str() + 7, nullptr, 16) >> 3) & 1;  // CAP_FOWNER 3
  return ::geteuid() == 0;  // no /proc: root has it unless its capabilities were dropped
}

// Why rename(2) cannot put a new file over the existing file `path` in `directory` (resolved: not a link), or "" where
// nothing says it cannot. rename needs more than write permission: the target must not be a mount point (EBUSY: a
// bind-mounted file, as a container's `-v FILE:FILE` makes), and in a sticky directory (S_ISVTX: /tmp, shared
// scratch) the file must be this user's, or the directory this user's, or the process must have CAP_FOWNER (EPERM).
// Both were found only at the rename, after the work; in a checkpoint's commit, after two of its files had been
// replaced (G20-1, twentieth pass).
std::string why_not_renamable(const std::string& path, const std::string& directory) {
  bool mount_point = false;
  struct statx fx {};
  if (::statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_MNT_ID, &fx) == 0) {
    if (fx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) {
      mount_point = fx.stx_attributes & STATX_ATTR_MOUNT_ROOT;
    } else {  // a kernel before 5.8: the mount ids, or the devices, of the file and its directory
      struct statx dx {};
      if (::statx(AT_FDCWD, directory.c_str(), 0, STATX_TYPE | STATX_MNT_ID, &dx) == 0)
        mount_point = (fx.stx_mask & dx.stx_mask & STATX_MNT_ID)
                          ? fx.stx_mnt_id != dx.stx_mnt_id
                          : fx.stx_dev_major != dx.stx_dev_major || fx.stx_dev_minor != dx.stx_dev_minor;
    }
  } else {
    struct stat fs_ {}, ds {};
    mount_point = ::lstat(path.c_str(), &fs_) == 0 && ::stat(directory.c_str(), &ds) == 0 && fs_.st_dev != ds.st_dev;
  }
  if (mount_point)
    return "is a mount point (a file mounted over that name: a bind mount, or a container's volume such as `-v "
           "FILE:FILE`), which rename(2) cannot replace (Device or resource busy); dmoe replaces an output whole by "
           "renaming a new file over it: give a path that is not a mount point (mount the directory rather than the "
           "file, or write elsewhere and copy the file over)";
  struct stat ds {}, fs_ {};
  if (::stat(directory.c_str(), &ds) == 0 && (ds.st_mode & S_ISVTX) && ::lstat(path.c_str(), &fs_) == 0) {
    const uid_t me = ::geteuid();
    if (fs_.st_uid != me && ds.st_uid != me && !has_cap_fowner())
      return fmt::format("belongs to another user (uid {}) in '{}', a directory with the sticky bit (mode {:04o}, as "
                         "/tmp), where only the file's owner, the directory's owner or a privileged process may "
                         "replace or remove a file (rename(2) gives Operation not permitted); dmoe replaces an output "
                         "whole by renaming a new file over it: give a path of your own (a new name, or a directory "
                         "of your own), or ask the file's owner (uid {}) to remove it", uint64_t(fs_.st_uid), directory,
                         unsigned(ds.st_mode & 07777), uint64_t(fs_.st_uid));
  }
  return {};
}

// Why no file can be replaced, renamed or removed in `directory`, or "": the directory has the append-only attribute
// (chattr +a, as audit and log directories have), where files can be created but not renamed or removed, so every
// check passed and the work ran, then the commit's rename failed (EPERM) naming dmoe's own journal, and a dozen hidden
// temporaries, probes and backups stayed for good (G21-2, twenty-first pass). An immutable directory (chattr +i) is
// found by the probe itself: nothing can be created there. File systems without attributes refuse the ioctl: "".
std::string why_directory_append_only(const std::string& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
  int flags = 0;
  if (fd < 0 || ::ioctl(fd, FS_IOC_GETFLAGS, &flags) != 0) flags = 0;
  if (fd >= 0) ::close(fd);
  if (!(flags & FS_APPEND_FL)) return {};
  return fmt::format("is in '{}', a directory with the append-only attribute (chattr +a), where files can be created "
                     "but not renamed or removed; dmoe writes an output whole to a temporary file beside it and renames "
                     "that over the target: clear the attribute (chattr -a '{}') or give a path in another directory",
                     directory, directory);
}

bool write_all(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    data += n;
    size -= size_t(n);
  }
  return true;
}

}  // namespace

void check_output_file(const std::string& path, std::string_view option) {
  const OutputTarget t = resolve_output(path, option);
  // Before the probe: in an append-only directory the probe could not be removed again (G21-2).
  if (const std::string why = why_directory_append_only(t.directory); !why.empty())
    DMOE_FAIL_INPUT("{} '{}' {}", option, path, why);
  std::string tmp;
  int slot = -1;  // registered too: a signal in the instant the probe exists left it behind
  const int fd = create_temporary(t, tmp, fmt::format("{} '{}'", option, path), &slot);
  ::close(fd);
  const int removed = ::unlink(tmp.c_str());
  const int unlink_errno = errno;
  release_temporary(slot);
  // A directory where a file can be created but not removed (the attribute unseen above: a file system whose ioctl
  // says nothing, an LSM rule): no output could be renamed into place there either.
  if (removed != 0 && unlink_errno != ENOENT)
    DMOE_FAIL_INPUT("{} '{}': a file created in '{}' cannot be removed again ({}): the directory lets files be "
                    "created but not removed or renamed (append-only: chattr +a?), and dmoe writes an output whole to a "
                    "temporary that it renames over the target; clear that (chattr -a '{}') or give a path in another "
                    "directory, and remove the probe '{}' left there", option, path, t.directory,
                    std::strerror(unlink_errno), t.directory, tmp);
  // An immutable or append-only file cannot be replaced by the rename, even by root: that failed only after the work.
  if (t.exists) {
    const int existing = ::open(t.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    int flags = 0;  // file systems without attributes (tmpfs, /proc) refuse the ioctl: nothing to say then
    if (existing < 0 || ::ioctl(existing, FS_IOC_GETFLAGS, &flags) != 0) flags = 0;
    if (existing >= 0) ::close(existing);
    DMOE_REQUIRE_INPUT(!(flags & (FS_IMMUTABLE_FL | FS_APPEND_FL)), "{} '{}' is {} (chattr); it cannot be replaced: "
                       "clear the attribute (chattr -{} '{}') or give another path", option, path,
                       flags & FS_IMMUTABLE_FL ? "immutable" : "append-only", flags & FS_IMMUTABLE_FL ? "i" : "a",
                       t.path);
    // A file the rename cannot replace: a mount point, another user's file in a sticky directory (G20-1).
    if (const std::string why = why_not_renamable(t.path, t.directory); !why.empty())
      DMOE_FAIL_INPUT("{} '{}'{} {}", option, path, t.path == path ? std::string() : fmt::format(" (its target '{}')",
                                                                                               t.path), why);
    // The rename needs only the directory's permission: a write-protected file (chmod a-w, or another user's file in
    // a directory this user may write) was replaced with rc 0, where `echo > FILE` says "Permission denied". Root may
    // write any file (access() says so), as its shell may.
    if (::access(t.path.c_str(), W_OK) != 0) {
      const int err = errno;
      DMOE_FAIL_INPUT("{} '{}' exists and this user may not write it ({}; mode {:04o}): dmoe replaces an output whole, "
                      "by renaming a new file over it, which would replace a write-protected file; make it writable "
                      "(chmod u+w '{}') or give another path", option, path, std::strerror(err), unsigned(t.mode), t.path);
    }
  }
}

void check_appended_output_file(const std::string& path, std::string_view option) {
  const OutputTarget t = resolve_output(path, option);
  DMOE_REQUIRE_INPUT(t.exists, "{} '{}': does not exist, and this run appends to it", option, path);
  const int fd = ::open(t.path.c_str(), O_WRONLY | O_APPEND | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    DMOE_FAIL_INPUT("{} '{}' cannot be opened for appending ({}; mode {:04o}): a resumed run appends its lines to its "
                    "log; make it writable (chmod u+w '{}'), or give a new --log", option, path, std::strerror(err),
                    unsigned(t.mode), t.path);
  }
  ::close(fd);
}

void OutputFileSet::write(const std::string& path, std::span<const uint8_t> bytes) {
  const OutputTarget t = resolve_output(path, "");
  const std::string what = fmt::format("writing '{}'", path);
  std::string tmp;
  int slot = -1;
  const int fd = create_temporary(t, tmp, what, &slot);
  auto fail = [&](const char* step, int fd_to_close) {
    const int err = errno;
    if (fd_to_close >= 0) ::close(fd_to_close);
    ::unlink(tmp.c_str());
    release_temporary(slot);
    const bool others = !written_.empty();
    discard();
    DMOE_FAIL_INPUT("{} failed at {} of its temporary '{}' ({} bytes): {}; '{}' is unchanged{}", what, step, tmp,
                    bytes.size(), std::strerror(err), path, others ? ", and so are the other outputs written with it" : "");
  };
  if (t.exists && ::fchmod(fd, t.mode) != 0) fail("setting the permissions", fd);
  if (!write_all(fd, bytes.data(), bytes.size())) fail("the write", fd);
  if (::fsync(fd) != 0) fail("fsync", fd);
  if (::close(fd) != 0) fail("close", -1);
  written_.push_back({path, tmp, t.path, t.directory, slot});
}

void OutputFileSet::write(const std::string& path, std::string_view text) {
  write(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

namespace {

// A journal names its files by their names in its own directory (a checkpoint directory that was moved, or is resumed
// from another working directory, still completes) and records the identity (device, inode) of each temporary and of
// the file it replaces: finish_interrupted_commit renames only where the directory is still as the kill left it.
fs::path journal_directory(const std::string& journal) {
  return fs::absolute(journal).lexically_normal().parent_path();
}

// A plain file name: no directory part, not "." or "..".
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

// A file's identity as a journal records it, "DEV:INO" ("none" where there is no file); links not followed.
std::string identity_of(const std::string& path) {
  struct stat s {};
  return ::lstat(path.c_str(), &s) == 0 ? fmt::format("{}:{}", uint64_t(s.st_dev), uint64_t(s.st_ino))
                                        : std::string("none");
}

// True when `temporary` is a name create_temporary gives beside `target`: ".NAME.dmoe-tmp.PID.N", NAME the target's
// file name or its first part (cut short to fit NAME_MAX).
bool temporary_name_of(const std::string& temporary, const std::string& target) {
  const size_t at = temporary.find(".dmoe-tmp.");
  return plain_file_name(temporary) && plain_file_name(target) && temporary[0] == '.' && at != std::string::npos &&
         at > 1 && at - 1 <= target.size() && target.compare(0, at - 1, temporary, 1, at - 1) == 0;
}

// A hard link to the file `target` (in `directory`) under a hidden name beside it, ".NAME.dmoe-old.PID.N" (NAME cut
// short as a temporary's): the file a commit is about to replace, kept until the commit ends so that a later rename of
// the set that fails can put it back (OutputFileSet::commit). "" where no link can be made (a file system without
// hard links, fs.protected_hardlinks, a path past the limits): that file cannot be put back then.
bool (*g_fail_backup_link_for_tests)(const std::string& target) = nullptr;

std::string link_backup(const std::string& target, const std::string& directory, int* error = nullptr) {
  if (g_fail_backup_link_for_tests && g_fail_backup_link_for_tests(target)) {
    if (error) *error = EPERM;
    return {};
  }
  static std::atomic<unsigned> counter{0};
  const std::string name = fs::path(target).filename().string();
  const std::string prefix = (fs::path(directory) / ".").string();  // "DIR/."
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::string suffix = fmt::format(".dmoe-old.{}.{}", ::getpid(), counter++);
    const size_t fixed = prefix.size() + suffix.size();
    if (fixed + 1 >= size_t(PATH_MAX)) return {};
    std::string backup = prefix;
    backup.append(name, 0, std::min({name.size(), size_t(NAME_MAX) - 1 - suffix.size(), size_t(PATH_MAX) - 1 - fixed}));
    backup += suffix;
    if (::link(target.c_str(), backup.c_str()) == 0) return backup;
    if (errno != EEXIST) {
      if (error) *error = errno;
      return {};
    }
  }
  if (error) *error = EEXIST;
  return {};
}

}  // namespace

void OutputFileSet::commit(const std::string& journal, GrowingOutputFile* publish) {
  if (publish && publish->published_) publish = nullptr;
  // A target that the rename cannot replace (a mount point, another user's file in a sticky directory) fails the whole
  // set here, before anything is renamed: check_output_file says so before the work, but the file may have become one
  // since (G20-1, twentieth pass: a bind-mounted optimizer.safetensors failed the checkpoint's third rename).
  {
    std::vector<std::tuple<std::string, std::string, std::string>> targets;  // shown path, target, its directory
    for (const Written& w : written_) targets.emplace_back(w.path, w.target, w.directory);
    if (publish) targets.emplace_back(publish->path_, publish->target_, publish->directory_);
    for (const auto& [path, target, directory] : targets) {
      // A directory made append-only since the check (G21-2): no rename can put a file in place there.
      if (const std::string why = why_directory_append_only(directory); !why.empty()) {
        discard();
        DMOE_FAIL_INPUT("writing '{}': it {}; nothing was replaced{}", path, why,
                        targets.size() > 1 ? " (nor any other file written with it)" : "");
      }
      struct stat ts {};
      if (::lstat(target.c_str(), &ts) != 0) continue;  // a new file: nothing to replace
      if (const std::string why = why_not_renamable(target, directory); !why.empty()) {
        discard();
        DMOE_FAIL_INPUT("writing '{}': '{}' {}; nothing was replaced{}", path, target, why,
                        targets.size() > 1 ? " (nor any other file written with it)" : "");
      }
    }
  }
  if (publish) {
    // Its pieces on the disk before the journal names it (GrowingOutputFile::publish does the same before its rename).
    DMOE_REQUIRE(publish->fd_ >= 0, "GrowingOutputFile: published with a commit after close ({})", publish->path_);
    if (::fsync(publish->fd_) != 0) {
      const int err = errno;
      discard();
      DMOE_FAIL_INPUT("{} '{}': fsync of its temporary '{}' failed: {}; it is unchanged, and so are the files to be "
                      "committed with it", publish->option_, publish->path_, publish->temporary_, std::strerror(err));
    }
  }
  // The renames back to back, signals held (above); the directories synced after, so that the window is short.
  g_committing.fetch_add(1);
  const auto end_of_commit = [] {
    if (g_committing.fetch_sub(1) == 1)
      if (const int sig = g_pending_signal.exchange(0); sig != 0) remove_temporaries_and_reraise(sig);
  };
  // A rename that fails part-way anyway (G20-1: a mount or a sticky directory the checks above did not see, EIO, a
  // file system gone read-only) left the files renamed before it replaced, the rest not: a checkpoint of two saves,
  // its journal removed, which every resume refused. Completing the set later is no way out (the same rename fails
  // again while its cause is there, and another user's file may never become replaceable), so the set is undone
  // instead: each file that a later rename of the set could leave replaced is first hard-linked to a backup beside it
  // (".NAME.dmoe-old.PID.N"; a link costs no space and no inode), and a failed rename renames the backups back over
  // the files already replaced (and removes the files the set created), leaving every target as it was. The backups go
  // when the commit ends; the journal names them, so that a commit killed between its renames (SIGKILL) and completed
  // by finish_interrupted_commit removes them too. Where a backup cannot be made (a file system without hard links)
  // and a rename fails after that file was replaced, the set is kept for completion instead: its journal and the
  // remaining temporaries stay, and finish_interrupted_commit completes it once the cause is gone.
  const size_t total = written_.size() + (publish ? 1 : 0);
  std::vector<std::string> backups(written_.size());  // "" where there is none
  std::vector<bool> existed(written_.size(), false);
  std::vector<int> backup_errno(written_.size(), 0);  // why a backup could not be linked (G21-9: the error said none)
  for (size_t i = 0; i < written_.size(); ++i) {
    struct stat ts {};
    existed[i] = ::lstat(written_[i].target.c_str(), &ts) == 0;
    if (existed[i] && i + 1 < total)
      backups[i] = link_backup(written_[i].target, written_[i].directory, &backup_errno[i]);
  }
  nlohmann::json record_json;  // the journal's record, rewritten with the failure where the set is kept (below)
  const auto remove_backups = [&backups] {
    for (std::string& b : backups)
      if (!b.empty()) ::unlink(std::exchange(b, std::string()).c_str());
  };
  if (!journal.empty()) {
    // Every temporary is complete (written, synced, closed); the journal says where each goes, before the first
    // rename. Written atomically itself (a nested set: the signals stay held).
    nlohmann::json renames = nlohmann::json::array();
    void (*hook)(size_t) = std::exchange(g_after_rename_for_tests, nullptr);  // the test hook counts the set's renames
    try {
      const fs::path dir = journal_directory(journal);
      // The journal is dmoe's own file: not a link (the write would replace the link's target) nor anything else.
      struct stat js {};
      DMOE_REQUIRE_INPUT(::lstat(journal.c_str(), &js) != 0 || S_ISREG(js.st_mode), "the commit journal '{}' is {}: "
                         "the name is dmoe's own (it records a save's renames); move it away", journal,
                         file_kind(js.st_mode));
      for (size_t i = 0; i < written_.size(); ++i) {
        const Written& w = written_[i];
        const fs::path target = fs::absolute(w.target).lexically_normal();
        // The directories compared by identity (G22A-1): a --save given through a link to the directory (lnk ->
        // real/ck) has its files resolved under real/ck, the same directory as lnk. A checkpoint file linked into
        // another directory is refused before the training (train's check_train_paths); one linked there since is
        // named here, before anything is renamed.
        // The paths as given (relative ones work in a working directory deeper than PATH_MAX, where the absolute
        // ones cannot be stat'ed); where either cannot be, compared as text, as before.
        const auto parent_of = [](const std::string& path) {
          const fs::path parent = fs::path(path).parent_path();
          return parent.empty() ? std::string(".") : parent.string();
        };
        struct stat target_dir {}, journal_dir {};
        const bool both = ::stat(parent_of(w.target).c_str(), &target_dir) == 0 &&
                          ::stat(parent_of(journal).c_str(), &journal_dir) == 0;
        const bool same_directory = both ? target_dir.st_dev == journal_dir.st_dev &&
                                               target_dir.st_ino == journal_dir.st_ino
                                         : target.parent_path() == dir;
        DMOE_REQUIRE_INPUT(same_directory,
                           "'{}' is (through a symbolic link) '{}', outside '{}': the files saved together with the "
                           "journal '{}' must all be in its directory; nothing was replaced: make '{}' a file of its "
                           "own", w.path, target.string(), dir.string(), journal, w.path);
        struct stat ts {}, old {};
        DMOE_REQUIRE(::lstat(w.temporary.c_str(), &ts) == 0, "the temporary '{}' is gone before its commit",
                     w.temporary);
        const bool replaces = ::lstat(w.target.c_str(), &old) == 0;
        // The names as path_for_json writes them: a name that is not UTF-8 made the dump below throw (G21-1).
        nlohmann::json entry{{"temporary", path_for_json(fs::path(w.temporary).filename().string())},
                             {"target", path_for_json(target.filename().string())},
                             {"temporary_id", fmt::format("{}:{}", uint64_t(ts.st_dev), uint64_t(ts.st_ino))},
                             {"replaced_id", replaces ? fmt::format("{}:{}", uint64_t(old.st_dev), uint64_t(old.st_ino))
                                                      : std::string("none")}};
        if (!backups[i].empty()) entry["backup"] = path_for_json(fs::path(backups[i]).filename().string());
        renames.push_back(std::move(entry));
      }
      record_json = nlohmann::json{{"dmoe_commit", 1}, {"renames", renames}};
      if (publish) {
        // Outside the journal's directory (a --log anywhere): absolute paths and the option that named it, for
        // finish_interrupted_commit to hold against the resuming command's own option (H6 of the seventeenth pass).
        struct stat ts {}, old {};
        DMOE_REQUIRE(::lstat(publish->temporary_.c_str(), &ts) == 0, "the temporary '{}' is gone before its commit",
                     publish->temporary_);
        const bool replaces = ::lstat(publish->target_.c_str(), &old) == 0;
        const nlohmann::json entry{
            {"option", publish->option_},
            {"temporary", path_for_json(fs::absolute(publish->temporary_).lexically_normal().string())},
            {"target", path_for_json(fs::absolute(publish->target_).lexically_normal().string())},
            {"temporary_id", fmt::format("{}:{}", uint64_t(ts.st_dev), uint64_t(ts.st_ino))},
            {"replaced_id", replaces ? fmt::format("{}:{}", uint64_t(old.st_dev), uint64_t(old.st_ino))
                                     : std::string("none")}};
        record_json["option_renames"] = nlohmann::json::array({entry});
      }
      OutputFileSet record;
      record.write(journal, record_json.dump(1) + "\n");
      record.commit();
      g_after_rename_for_tests = hook;
    } catch (...) {
      g_after_rename_for_tests = hook;
      remove_backups();
      discard();
      end_of_commit();
      throw;
    }
  }
  std::vector<std::string> directories;
  const auto add_directory = [&directories](const std::string& d) {
    if (std::find(directories.begin(), directories.end(), d) == directories.end()) directories.push_back(d);
  };
  const auto sync_directories = [&directories] {
    // Make the renames durable; a directory that cannot be synced (some file systems) is no error.
    for (const std::string& d : directories) {
      const int dir = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dir >= 0) {
        (void)::fsync(dir);
        ::close(dir);
      }
    }
  };
  std::vector<std::string> renamed_ids(written_.size());  // each renamed file's identity (its temporary's)
  size_t failed = total;  // the rename that failed (written_.size(): the published file's), total: none
  int failed_errno = 0;
  for (size_t i = 0; i < written_.size(); ++i) {
    const Written& w = written_[i];
    renamed_ids[i] = identity_of(w.temporary);
    if (::rename(w.temporary.c_str(), w.target.c_str()) != 0) {
      failed = i;
      failed_errno = errno;
      break;
    }
    release_temporary(w.slot);
    if (g_after_rename_for_tests) g_after_rename_for_tests(i);
    add_directory(w.directory);
  }
  // Last, as GrowingOutputFile::publish did after the commit: the log describes the files now in place.
  if (failed == total && publish) {
    if (::rename(publish->temporary_.c_str(), publish->target_.c_str()) != 0) {
      failed = written_.size();
      failed_errno = errno;
    } else {
      release_temporary(publish->slot_);
      publish->slot_ = -1;
      publish->published_ = true;  // its pieces go on into the same file, now under the target's name
      if (g_after_rename_for_tests) g_after_rename_for_tests(written_.size());
      add_directory(publish->directory_);
    }
  }
  if (failed < total) {
    const std::string path = failed < written_.size() ? written_[failed].path : publish->path_;
    const std::string cause = fmt::format("writing '{}' failed at the rename of its temporary onto it: {}; it is "
                                          "unchanged", path, std::strerror(failed_errno));
    std::string replaced, no_backup;
    bool undoable = true;
    for (size_t j = 0; j < failed; ++j) {
      replaced += fmt::format("{}'{}'", j ? ", " : "", written_[j].path);
      undoable = undoable && (!backups[j].empty() || !existed[j]);
      if (backups[j].empty() && existed[j])
        no_backup += fmt::format("{}'{}' ({})", no_backup.empty() ? "" : ", ", written_[j].path,
                                 std::strerror(backup_errno[j]));
    }
    if (failed == 0) {  // nothing replaced
      remove_backups();
      discard();
      if (!journal.empty()) ::unlink(journal.c_str());  // its temporaries are gone: nothing to complete
      end_of_commit();
      DMOE_FAIL_INPUT("{}{}", cause, total > 1 ? ", and so are the other files written with it" : "");
    }
    if (!undoable && !journal.empty()) {
      // No backup of a file already replaced: kept for completion (above). The temporaries not renamed stay (released
      // from the signal handler's table and from this set), and so does the published file's.
      for (size_t j = failed; j < written_.size(); ++j) release_temporary(written_[j].slot);
      written_.clear();
      std::string log_kept;
      if (publish) {
        release_temporary(publish->slot_);
        publish->slot_ = -1;
        log_kept = fmt::format(" (and '{}', {}'s)", publish->temporary_, publish->option_);
        publish->temporary_.clear();  // not removed with the GrowingOutputFile: the journal names it
      }
      // The journal says the commit failed, and why, for the note of whoever completes it: it said "(the process
      // killed)" for a rename that had failed (G21-9). Best effort: where the journal cannot be rewritten, it stays.
      record_json["failed"] = fmt::format("the rename of '{}' failed: {}", path, std::strerror(failed_errno));
      {
        void (*hook)(size_t) = std::exchange(g_after_rename_for_tests, nullptr);
        try {
          OutputFileSet record;
          record.write(journal, record_json.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
          record.commit();
        } catch (const std::exception&) {
        }
        g_after_rename_for_tests = hook;
      }
      end_of_commit();
      sync_directories();
      DMOE_FAIL_INPUT("{}; {} were replaced already and cannot be put back (no backup of {} could be linked, so "
                      "the set was left to be completed rather than undone): its journal '{}' and the remaining "
                      "temporaries{} stay beside it, and completing the journal once '{}' can be replaced puts every "
                      "file in place (train --resume does, for a checkpoint)", cause, replaced, no_backup, journal,
                      log_kept, path);
    }
    // Undo: the journal first (a journal naming files put back would have them taken for changed since the save), then
    // each replaced file back from its backup, each new one removed.
    if (!journal.empty()) ::unlink(journal.c_str());
    std::string not_restored;
    for (size_t j = failed; j-- > 0;) {
      const Written& w = written_[j];
      bool ok = false;
      if (!backups[j].empty()) {
        ok = ::rename(backups[j].c_str(), w.target.c_str()) == 0;
        if (ok) backups[j].clear();
      } else if (!existed[j]) {
        ok = identity_of(w.target) != renamed_ids[j] || ::unlink(w.target.c_str()) == 0;
      }
      if (!ok)
        not_restored += fmt::format("{}'{}'{}", not_restored.empty() ? "" : ", ", w.path,
                                    backups[j].empty() ? std::string() : fmt::format(" (its earlier content is in '{}')",
                                                                                     backups[j]));
      if (!ok && !backups[j].empty()) backups[j].clear();  // kept for the user: named above
      add_directory(w.directory);
    }
    // G22B-7 (d): the files the set created were said to have been "replaced and put back"; they were removed.
    // (Listed before the set's entries go, below.)
    std::string put_back, removed_new;
    size_t n_put_back = 0, n_removed = 0;
    for (size_t j = 0; j < failed; ++j) {
      std::string& list = existed[j] ? put_back : removed_new;
      list += fmt::format("{}'{}'", list.empty() ? "" : ", ", written_[j].path);
      ++(existed[j] ? n_put_back : n_removed);
    }
    remove_backups();
    written_.erase(written_.begin(), written_.begin() + std::ptrdiff_t(failed));
    discard();
    end_of_commit();
    sync_directories();
    if (!not_restored.empty())
      DMOE_FAIL_INPUT("{}; the files replaced or created before it ({}) were to be put back, but {} could not be: "
                      "the set is mixed there", cause, replaced, not_restored);
    std::string undone;
    if (n_put_back > 0)
      undone = fmt::format("{} had been replaced and {} put back as {}", put_back, n_put_back == 1 ? "was" : "were",
                           n_put_back == 1 ? "it was" : "they were");
    if (n_removed > 0)
      undone += fmt::format("{}{}, new, {} created and removed again", undone.empty() ? "" : ", and ", removed_new,
                            n_removed == 1 ? "was" : "were");
    DMOE_FAIL_INPUT("{}, and so are the other files written with it: {}", cause, undone);
  }
  written_.clear();
  // Every file is in place: the backups and then the journal have nothing left to keep.
  remove_backups();
  if (!journal.empty()) ::unlink(journal.c_str());
  // The files the new ones replace, before a held-back signal ends the process (G19-4: removed after the commit, the
  // old shards stayed beside the new model when a signal came during the renames).
  for (const std::string& path : std::exchange(removed_after_commit_, {})) {
    ::unlink(path.c_str());  // a failure leaves it (it is no longer part of the model)
    const fs::path p(path);
    const std::string d = p.has_parent_path() ? p.parent_path().string() : std::string(".");
    if (std::find(directories.begin(), directories.end(), d) == directories.end()) directories.push_back(d);
  }
  end_of_commit();
  if (!journal.empty()) add_directory(journal_directory(journal).string());
  sync_directories();
}

std::string finish_interrupted_commit(const std::string& journal, const std::vector<NamedPath>& outputs,
                                      std::string* left, std::string* failure) {
  if (left) left->clear();
  if (failure) failure->clear();
  struct stat st {};
  if (::lstat(journal.c_str(), &st) != 0) {
    DMOE_REQUIRE_INPUT(errno == ENOENT || errno == ENOTDIR, "the commit journal '{}' cannot be inspected: {}", journal,
                       std::strerror(errno));
    return {};
  }
  const std::string move_away = fmt::format("; to use the files as they are, remove '{}' (and the hidden "
                                            "'.NAME.dmoe-tmp.PID.N' files beside it)", journal);
  DMOE_REQUIRE_INPUT(S_ISREG(st.st_mode) && st.st_size < (1 << 20), "the commit journal '{}' is {} of {} bytes, not "
                     "a journal dmoe writes (a small regular file){}", journal, file_kind(st.st_mode),
                     int64_t(st.st_size), move_away);
  std::ifstream in(journal, std::ios::binary);
  if (!in.is_open()) {
    // Another rank completing the same journal may have removed it since the lstat: then every file is in place.
    const int err = errno;
    if (err == ENOENT) return {};
    DMOE_FAIL_INPUT("the commit journal '{}' cannot be read: {}", journal, std::strerror(err));
  }
  std::stringstream text;
  text << in.rdbuf();
  DMOE_REQUIRE_INPUT(!in.bad(), "the commit journal '{}' cannot be read", journal);
  const nlohmann::json record = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  const auto is_string = [](const nlohmann::json& j, const char* key) {
    return j.contains(key) && j.at(key).is_string();
  };
  DMOE_REQUIRE_INPUT(record.is_object() && record.contains("dmoe_commit") && record["dmoe_commit"].is_number_integer() &&
                         record["dmoe_commit"].get<int64_t>() == 1 && record.contains("renames") &&
                         record["renames"].is_array(),
                     "the commit journal '{}' is not one dmoe wrote (expected {{\"dmoe_commit\": 1, \"renames\": "
                     "[...]}}): the files beside it are left as they are{}", journal, move_away);
  // A commit whose rename failed and that could not be undone records why (OutputFileSet::commit, G21-9).
  if (failure && record.contains("failed") && record["failed"].is_string()) *failure = record["failed"].get<std::string>();
  const fs::path dir = journal_directory(journal);
  struct Rename {
    std::string temporary, target, temporary_id, replaced_id;
    std::string backup = {};  // the replaced file's hard link the commit kept (OutputFileSet::commit), or ""
  };
  std::vector<Rename> renames;
  for (const nlohmann::json& r : record["renames"]) {
    DMOE_REQUIRE_INPUT(r.is_object() && is_string(r, "temporary") && is_string(r, "target") &&
                           is_string(r, "temporary_id") && is_string(r, "replaced_id"),
                       "the commit journal '{}' has an entry without the 'temporary', 'target', 'temporary_id' and "
                       "'replaced_id' strings dmoe writes: {}{}", journal, r.dump(), move_away);
    const std::string temporary = path_from_json(r["temporary"].get<std::string>()),
                      target = path_from_json(r["target"].get<std::string>());
    // File names in the journal's directory only, and only dmoe's own temporaries are moved: a journal edited by hand
    // (or come with a downloaded checkpoint) must not move or replace files elsewhere.
    DMOE_REQUIRE_INPUT(plain_file_name(temporary) && plain_file_name(target) &&
                           temporary.find(".dmoe-tmp.") != std::string::npos,
                       "the commit journal '{}' names '{}' onto '{}': dmoe's journals name a '.NAME.dmoe-tmp.PID.N' "
                       "temporary and a file of their own directory only{}", journal, temporary, target, move_away);
    // The backup of the file replaced (since the twentieth pass): a '.NAME.dmoe-old.PID.N' of the same directory.
    std::string backup;
    if (r.contains("backup")) {
      DMOE_REQUIRE_INPUT(r["backup"].is_string() && plain_file_name(path_from_json(r["backup"].get<std::string>())) &&
                             path_from_json(r["backup"].get<std::string>()).find(".dmoe-old.") != std::string::npos,
                         "the commit journal '{}' names the backup {} for '{}': dmoe's journals name a "
                         "'.NAME.dmoe-old.PID.N' file of their own directory{}", journal, r["backup"].dump(), target,
                         move_away);
      backup = (dir / path_from_json(r["backup"].get<std::string>())).string();
    }
    renames.push_back({(dir / temporary).string(), (dir / target).string(), r["temporary_id"].get<std::string>(),
                       r["replaced_id"].get<std::string>(), backup});
  }
  // Every file must be as the killed commit left it: its temporary still there and the file it replaces unchanged,
  // or the rename done (the target is the temporary). A checkpoint restored by hand since (`cp backup/* ck/` skips the
  // hidden journal) would otherwise be overwritten by the stale temporaries.
  // The temporary first: another rank renaming between the two reads is then seen as pending, done, or in flight
  // (the target already the temporary's file, the temporary's name read before the rename).
  const auto state_of = [](const Rename& r, std::string& temporary_now, std::string& target_now) {
    temporary_now = identity_of(r.temporary);
    target_now = identity_of(r.target);
    const bool pending = temporary_now == r.temporary_id && target_now == r.replaced_id;
    const bool done = (temporary_now == "none" || temporary_now == r.temporary_id) && target_now == r.temporary_id;
    return pending || done;
  };
  const auto what_changed = [](const Rename& r, const std::string& temporary_now) {
    // "none" for the temporary alone: renamed, and the file there is another since (G22A-6: the message said neither
    // was there, where both were, copied).
    return temporary_now == "none" ? (identity_of(r.target) == "none"
                                          ? "neither the save's new file nor its temporary is there"
                                          : "its temporary is gone and the file there is not the save's new one")
           : temporary_now != r.temporary_id ? "its temporary is not the one the save wrote"
                                             : "it is not the file the save was replacing";
  };
  // A file of an option (a new run's --log, published with the save: OutputFileSet::commit's `publish`) is outside the
  // journal's directory. H2's rule holds for it too, a journal never has dmoe rename onto a path of its choosing: it
  // is completed only onto this command's own file of that option, the same file the save was replacing, from dmoe's
  // temporary of that name beside it (H6 of the seventeenth pass: the log stayed the earlier run's).
  std::vector<Rename> option_renames;
  std::string left_out;
  if (record.contains("option_renames")) {
    DMOE_REQUIRE_INPUT(record["option_renames"].is_array(), "the commit journal '{}' is not one dmoe wrote (its "
                       "'option_renames' is no array): the files beside it are left as they are{}", journal, move_away);
    for (const nlohmann::json& r : record["option_renames"]) {
      DMOE_REQUIRE_INPUT(r.is_object() && is_string(r, "option") && is_string(r, "temporary") &&
                             is_string(r, "target") && is_string(r, "temporary_id") && is_string(r, "replaced_id"),
                         "the commit journal '{}' has an entry without the 'option', 'temporary', 'target', "
                         "'temporary_id' and 'replaced_id' strings dmoe writes: {}{}", journal, r.dump(), move_away);
      const std::string option = r["option"].get<std::string>();
      const std::string target = path_from_json(r["target"].get<std::string>());
      const std::string temporary = path_from_json(r["temporary"].get<std::string>());
      const std::string temporary_id = r["temporary_id"].get<std::string>();
      const std::string temporary_name = fs::path(temporary).filename().string();
      DMOE_REQUIRE_INPUT(temporary_name_of(temporary_name, fs::path(target).filename().string()),
                         "the commit journal '{}' names '{}' onto {} '{}': dmoe's journals name a "
                         "'.NAME.dmoe-tmp.PID.N' temporary of that file's own name{}", journal, temporary, option,
                         target, move_away);
      const auto given = std::find_if(outputs.begin(), outputs.end(), [&](const NamedPath& out) {
        return out.option == option && !out.path.empty();
      });
      if (given == outputs.end()) {
        // This command writes no such file: the entry is left alone (the saved files are whole without it); where its
        // new content still waits in its temporary, the caller says so.
        if (identity_of(temporary) == temporary_id && identity_of(target) != temporary_id)
          left_out += fmt::format("{}'{}' (the new content of {} '{}'; mv '{}' '{}' puts it in place)",
                                  left_out.empty() ? "" : "; ", temporary, option, target, temporary, target);
        continue;
      }
      // The command's own file, resolved as it will be written (a symbolic link to its target); the temporary is
      // looked for beside it, so a moved directory still completes, and a journal naming another directory moves
      // nothing there.
      const OutputTarget own = resolve_output(given->path, option);
      const Rename rename{(fs::path(own.directory) / temporary_name).string(), own.path, temporary_id,
                          r["replaced_id"].get<std::string>()};
      std::string temporary_now, target_now;
      if (state_of(rename, temporary_now, target_now)) {
        option_renames.push_back(rename);
        continue;
      }
      const bool same_path = fs::absolute(own.path).lexically_normal() == fs::path(target).lexically_normal();
      DMOE_REQUIRE_INPUT(same_path, "the commit journal '{}' records a save killed before it put its {} '{}' in place, "
                         "but this command's {} '{}' is another file: give {} '{}' to complete the save with it, or "
                         "leave {} out to complete the save's other files alone{}; nothing was renamed", journal,
                         option, target, option, given->path, option, target, option,
                         identity_of(temporary) == temporary_id ? fmt::format(" (its content stays in '{}')", temporary)
                                                                : std::string());
      // Where the killed run's content is, if it is still there.
      const std::string content = temporary_now == temporary_id ? fmt::format("; its content stays in '{}'",
                                                                              rename.temporary) : std::string();
      DMOE_FAIL_INPUT("the commit journal '{}' records a save killed before it put its {} '{}' in place, but that "
                      "file has changed since ({}): it cannot be completed without replacing a file the save did not "
                      "write; nothing was renamed: leave {} out to complete the save's other files alone{}, or, to use "
                      "the files as they are, remove '{}' (and the hidden '.NAME.dmoe-tmp.PID.N' files beside it)",
                      journal, option, given->path, what_changed(rename, temporary_now), option, content, journal);
    }
  }
  // G22A-6: a directory copied since the kill (cp -a, rsync, a move to another disk) has every name where the kill
  // left it, but none of the identities the journal recorded. Each file was refused as changed, with the advice to
  // remove the journal, which left a set of two saves that every resume refused, the new save whole in the
  // temporaries. Said as what it is, with the renames that complete the save by hand: dmoe cannot tell a copy of the
  // killed directory from files restored by hand, so it does not rename them itself.
  {
    bool copied = !renames.empty();
    for (const Rename& r : renames) {
      const std::string temporary_now = identity_of(r.temporary), target_now = identity_of(r.target);
      const bool recorded = temporary_now == r.temporary_id || target_now == r.temporary_id ||
                            (r.replaced_id != "none" && target_now == r.replaced_id);
      copied = copied && !recorded && (temporary_now != "none" || target_now != "none");
    }
    if (copied) {
      std::string commands;
      for (const std::vector<Rename>* set : {&renames, &option_renames})
        for (const Rename& r : *set)
          if (identity_of(r.temporary) != "none") commands += fmt::format("mv '{}' '{}' && ", r.temporary, r.target);
      for (const Rename& r : renames)
        if (!r.backup.empty() && identity_of(r.backup) != "none") commands += fmt::format("rm '{}' && ", r.backup);
      commands += fmt::format("rm '{}'", journal);
      DMOE_FAIL_INPUT("the commit journal '{}' records a save killed between its renames, but none of the files it "
                      "names is the file it recorded (each has another device or inode number, though every name is "
                      "there): the directory was copied or restored since the save was killed (cp -a, rsync, a move to "
                      "another disk), so dmoe cannot tell whether they are still that save's files, and renamed "
                      "nothing. If it is a copy of the directory as the kill left it, the save's new files are whole in "
                      "its temporaries; to complete the save by hand: {}; or resume from the directory it was copied "
                      "from (removing the journal alone leaves files of two saves, which no resume takes)",
                      journal, commands);
    }
  }
  for (const Rename& r : renames) {
    std::string temporary_now, target_now;
    DMOE_REQUIRE_INPUT(state_of(r, temporary_now, target_now), "the commit journal '{}' records a save killed between "
                       "its renames, but '{}' has changed since ({}): the save cannot be completed without replacing "
                       "files it did not write{}", journal, r.target, what_changed(r, temporary_now), move_away);
  }
  renames.insert(renames.end(), option_renames.begin(), option_renames.end());  // last, as the commit renames them
  std::string completed;
  for (const Rename& r : renames) {
    if (identity_of(r.temporary) != r.temporary_id) continue;  // renamed before the kill
    // ENOENT: another process completing the same journal (every rank of a resumed run calls this) renamed it first.
    if (::rename(r.temporary.c_str(), r.target.c_str()) != 0) {
      DMOE_REQUIRE_INPUT(errno == ENOENT, "completing the commit of '{}' (journal '{}'): renaming '{}' onto it failed: "
                         "{}", r.target, journal, r.temporary, std::strerror(errno));
      continue;
    }
    completed += fmt::format("{}'{}'", completed.empty() ? "" : ", ", r.target);
  }
  // The files the commit kept to undo it with, now replaced for good: removed, where each is still that file.
  for (const Rename& r : renames)
    if (!r.backup.empty() && identity_of(r.backup) == r.replaced_id) ::unlink(r.backup.c_str());
  ::unlink(journal.c_str());  // last, so that whoever finds it gone finds every file in place
  std::vector<std::string> directories = {dir.string()};
  for (const Rename& r : option_renames)
    directories.push_back(fs::path(r.target).has_parent_path() ? fs::path(r.target).parent_path().string() : ".");
  for (const std::string& d : directories) {
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
      (void)::fsync(fd);
      ::close(fd);
    }
  }
  if (left) *left = left_out;
  return completed;
}

void set_backup_link_failure_for_tests(bool (*fail)(const std::string& target)) {
  g_fail_backup_link_for_tests = fail;
}

void set_after_rename_hook_for_tests(void (*hook)(size_t renamed_index)) { g_after_rename_for_tests = hook; }

void OutputFileSet::remove_after_commit(const std::string& path) { removed_after_commit_.push_back(path); }

void OutputFileSet::discard() {
  for (const Written& w : written_) {
    ::unlink(w.temporary.c_str());
    release_temporary(w.slot);
  }
  written_.clear();
  removed_after_commit_.clear();  // nothing was replaced: every file stays
}

OutputFileSet::~OutputFileSet() { discard(); }

void write_file_atomically(const std::string& path, std::span<const uint8_t> bytes) {
  OutputFileSet file;
  file.write(path, bytes);
  file.commit();
}

void write_file_atomically(const std::string& path, std::string_view text) {
  write_file_atomically(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

GrowingOutputFile::GrowingOutputFile(const std::string& path, std::string_view option, bool append)
    : path_(path), option_(option) {
  const OutputTarget t = resolve_output(path, option);
  target_ = t.path;
  directory_ = t.directory;
  const std::string what = fmt::format("{} '{}'", option, path);
  if (append) {
    DMOE_REQUIRE_INPUT(t.exists, "{}: does not exist, and this run appends to it (a resumed run continues its log)",
                       what);
    fd_ = ::open(target_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    DMOE_REQUIRE_INPUT(fd_ >= 0, "{}: cannot be opened for appending: {}", what, std::strerror(errno));
    struct stat st {};
    size_ = ::fstat(fd_, &st) == 0 ? uint64_t(st.st_size) : 0;
    published_ = true;
    return;
  }
  fd_ = create_temporary(t, temporary_, what, &slot_);
  if (t.exists) (void)::fchmod(fd_, t.mode);  // the file it replaces keeps its permission bits
  replaces_ = t.exists;
}

void GrowingOutputFile::write(std::string_view piece, std::string_view what) {
  DMOE_REQUIRE(fd_ >= 0, "GrowingOutputFile: write after close ({})", path_);
  if (write_all(fd_, reinterpret_cast<const uint8_t*>(piece.data()), piece.size())) {
    size_ += piece.size();
    // With no earlier file to keep, the first piece publishes: a new run's log that failed or was stopped (Ctrl-C after
    // 200 steps) was removed with its temporary, the whole loss history gone, though it replaced nothing.
    if (!published_ && !replaces_) publish();
    return;
  }
  const int err = errno;
  (void)::ftruncate(fd_, off_t(size_));  // no part of a piece stays at the end
  DMOE_FAIL_INPUT("{} '{}': {}a write failed: {} (disk full, or a file size limit?); {}", option_, path_,
                  what.empty() ? std::string() : fmt::format("writing {}: ", what), std::strerror(err),
                  published_ ? fmt::format("the file keeps the {} bytes before it", size_)
                             : "nothing was published yet: the earlier file is unchanged");
}

void GrowingOutputFile::truncate(uint64_t bytes) {
  DMOE_REQUIRE(fd_ >= 0 && bytes <= size_, "GrowingOutputFile: truncate {} of {} bytes ({})", bytes, size_, path_);
  DMOE_REQUIRE_INPUT(::ftruncate(fd_, off_t(bytes)) == 0, "{} '{}': cannot be cut back to {} bytes: {}", option_, path_,
                     bytes, std::strerror(errno));
  size_ = bytes;
}

void GrowingOutputFile::publish() {
  if (published_) return;
  DMOE_REQUIRE_INPUT(::fsync(fd_) == 0, "{} '{}': fsync of its temporary '{}' failed: {}", option_, path_, temporary_,
                     std::strerror(errno));
  DMOE_REQUIRE_INPUT(::rename(temporary_.c_str(), target_.c_str()) == 0, "{} '{}': the rename of its temporary '{}' "
                     "onto it failed: {}; it is unchanged", option_, path_, temporary_, std::strerror(errno));
  release_temporary(slot_);
  slot_ = -1;
  published_ = true;
  const int dir = ::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

void GrowingOutputFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  const bool synced = ::fsync(fd) == 0;
  const int err = errno;
  const bool closed = ::close(fd) == 0;
  DMOE_REQUIRE_INPUT(synced && closed, "{} '{}': {} failed: {}", option_, path_, synced ? "close" : "fsync",
                     std::strerror(synced ? errno : err));
}

GrowingOutputFile::~GrowingOutputFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!published_ && !temporary_.empty()) {
    ::unlink(temporary_.c_str());
    release_temporary(slot_);
  }
}

ExclusiveLock::~ExclusiveLock() {
  if (!transient_path_.empty()) {
    // Removed while still locked, and only while the name is still this file (never another process's new one).
    struct stat held {}, named {};
    if (::fstat(fd_, &held) == 0 && ::lstat(transient_path_.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino)
      ::unlink(transient_path_.c_str());
    release_temporary(transient_slot_);
  }
  if (fd_ >= 0) ::close(fd_);
}

ExclusiveLock::Outcome ExclusiveLock::lock_transient_file(const std::string& path, std::string_view what,
                                                          std::string* why) {
  DMOE_REQUIRE(fd_ < 0, "ExclusiveLock: already holds a lock");
  // Each round loses only to a holder that removed the file between this open and this lock: bounded in practice, and
  // bounded here so that a file system that keeps changing the name cannot spin us.
  for (int round = 0; round < 1000; ++round) {
    // One open (G23A-9: a first open that created the file and a second that failed left it behind): created here, or
    // an existing one opened (read-only where another user's holder made it 0644: flock needs no write access).
    bool created = true;
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd_ < 0 && errno == EEXIST) {
      created = false;
      fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
      if (fd_ < 0 && errno == EACCES) fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
      if (fd_ < 0 && errno == ENOENT) continue;  // its holder removed it meanwhile: create it
    }
    if (fd_ < 0) {
      const int e = errno;
      struct stat st {};
      const bool exists = ::lstat(path.c_str(), &st) == 0;
      DMOE_REQUIRE_INPUT(!exists || S_ISREG(st.st_mode), "{}: '{}' is {}: that name is the lock file dmoe takes while "
                         "a run writes it (an empty regular file, made and removed by dmoe; a link there is never "
                         "followed); move it away", what, path, S_ISLNK(st.st_mode) ? "a symbolic link"
                         : S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
      if (!exists && (e == EACCES || e == EPERM || e == EROFS)) {
        if (why) *why = std::strerror(e);
        return Outcome::unavailable;
      }
      DMOE_REQUIRE_INPUT(false, "{}: the lock file '{}' cannot be opened or made: {}", what, path, std::strerror(e));
    }
    const auto give_up = [&] {
      if (created) ::unlink(path.c_str());  // made by this call and never held: not left behind
      ::close(fd_);
      fd_ = -1;
    };
    struct stat held {};
    if (::fstat(fd_, &held) != 0 || !S_ISREG(held.st_mode) || held.st_size != 0) {
      const bool regular = S_ISREG(held.st_mode);
      const auto size = int64_t(held.st_size);
      give_up();
      DMOE_REQUIRE_INPUT(false, "{}: '{}' is {}: that name is the lock file dmoe takes while a run writes it (an empty "
                         "file dmoe makes and removes), and dmoe never takes over or removes a file with content; move "
                         "it away", what, path, regular ? fmt::format("a file of {} bytes", size) : "not a regular file");
    }
    if (!lock(/*wait=*/false)) {
      // Held by another process, which may have opened the file this call just made: that file is its now.
      ::close(fd_);
      fd_ = -1;
      return Outcome::busy;
    }
    struct stat named {};
    if (::lstat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      transient_path_ = path;
      transient_slot_ = register_temporary(path);
      return Outcome::held;
    }
    ::close(fd_);
    fd_ = -1;
  }
  DMOE_REQUIRE_INPUT(false, "{}: the lock file '{}' was replaced 1000 times while this process took it: another "
                     "process keeps removing it", what, path);
  return Outcome::busy;
}

ExclusiveLock::Outcome ExclusiveLock::lock_existing_file(const std::string& path) {
  DMOE_REQUIRE(fd_ < 0, "ExclusiveLock: already holds a lock");
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) return Outcome::unavailable;
  if (lock(/*wait=*/false)) return Outcome::held;
  ::close(fd_);
  fd_ = -1;
  return Outcome::busy;
}

bool ExclusiveLock::lock(bool wait) {
  while (::flock(fd_, LOCK_EX | (wait ? 0 : LOCK_NB)) != 0) {
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK) return false;
    break;  // ENOLCK, EINVAL, EOPNOTSUPP: a file system without flock; no lock, as before
  }
  return true;
}

bool ExclusiveLock::lock_directory(const std::string& directory, std::string_view what, bool wait) {
  DMOE_REQUIRE(fd_ < 0, "ExclusiveLock: already holds a lock");
  fd_ = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DMOE_REQUIRE_INPUT(fd_ >= 0, "{}: the directory '{}' cannot be opened: {}", what, directory, std::strerror(errno));
  return lock(wait);
}

bool ExclusiveLock::lock_file(const std::string& path, std::string_view what, bool wait) {
  DMOE_REQUIRE(fd_ < 0, "ExclusiveLock: already holds a lock");
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  DMOE_REQUIRE_INPUT(fd_ >= 0, "{}: the lock file '{}' cannot be opened: {}", what, path, std::strerror(errno));
  return lock(wait);
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  const bool a_exists = ::stat(a.c_str(), &sa) == 0, b_exists = ::stat(b.c_str(), &sb) == 0;
  if (a_exists && b_exists) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  // A path that exists and one that does not are two files.
  if (a_exists != b_exists) return false;
  // Neither exists (two new outputs): the same name in the same directory, the directories compared by identity. stat
  // works on a relative path however deep the working directory is; making the paths absolute does not there (a
  // working directory longer than PATH_MAX: getcwd fails), and two such paths used to compare equal as two empty
  // ones, so that `init --out a.st --input b.st` was refused as "the same file" (F6 of the eighteenth bad-input pass).
  // The path is split as given, at its last '/', and the directory part left to the kernel: "lnk/../o.json" (lnk a
  // link to other/dir) is o.json in other/, where the kernel writes it. Normalised lexically first, it was "./o.json",
  // so that `--json lnk/../o.json --trace other/o.json` wrote both into one file, rc 0, and `--json lnk/../q.json
  // --trace ./q.json` (two files) was refused as one (G20-2 of the twentieth bad-input pass).
  const auto split = [](const std::string& path) {
    std::string s = path;
    while (s.size() > 1 && s.back() == '/') s.pop_back();  // "dir/" names dir
    const size_t slash = s.rfind('/');
    if (slash == std::string::npos) return std::pair<std::string, std::string>{".", s};
    return std::pair<std::string, std::string>{slash == 0 ? std::string("/") : s.substr(0, slash), s.substr(slash + 1)};
  };
  const auto [dir_a, name_a] = split(a);
  const auto [dir_b, name_b] = split(b);
  const auto plain = [](const std::string& name) { return !name.empty() && name != "." && name != ".."; };
  if (plain(name_a) && plain(name_b)) {
    struct stat da {}, db {};
    const bool da_ok = ::stat(dir_a.c_str(), &da) == 0, db_ok = ::stat(dir_b.c_str(), &db) == 0;
    if (da_ok && db_ok) return da.st_dev == db.st_dev && da.st_ino == db.st_ino && name_a == name_b;
    if (da_ok != db_ok) return false;
  }
  // Missing directories too: the absolute paths, their existing part resolved (weakly_canonical follows the links, so
  // "lnk/.." is lnk's target's parent) and the rest normalised; where one cannot be made absolute, the paths as given.
  std::error_code ec_a, ec_b;
  const fs::path pa = fs::weakly_canonical(fs::absolute(a, ec_a), ec_a);
  const fs::path pb = fs::weakly_canonical(fs::absolute(b, ec_b), ec_b);
  if (ec_a || ec_b) return fs::path(a).lexically_normal() == fs::path(b).lexically_normal();
  return pa.lexically_normal() == pb.lexically_normal();
}

void require_distinct_files(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const NamedPath& out = outputs[i];
    if (out.path.empty()) continue;
    for (const NamedPath& in : inputs)
      DMOE_REQUIRE_INPUT(in.path.empty() || !same_file(out.path, in.path),
                         "{} '{}' is the same file as {} '{}': writing it would destroy that input; choose another {}",
                         out.option, out.path, in.option, in.path, out.option);
    for (size_t j = 0; j < i; ++j)
      DMOE_REQUIRE_INPUT(outputs[j].path.empty() || !same_file(out.path, outputs[j].path),
                   "{} '{}' and {} '{}' are the same file: one output would overwrite the other", outputs[j].option,
                         outputs[j].path, out.option, out.path);
  }
}

}  // namespace dmoe

namespace dmoe {

namespace {
constexpr std::string_view kPathBytesMarker = "dmoe-bytes:";
}

bool is_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    // overlong forms, UTF-16 surrogates and code points past U+10FFFF are not UTF-8
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n + 1;
  }
  return true;
}

std::string path_for_json(std::string_view path) {
  if (is_utf8(path) && path.substr(0, kPathBytesMarker.size()) != kPathBytesMarker) return std::string(path);
  std::string out(kPathBytesMarker);
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (const char ch : path) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '%' || c < 0x20 || c >= 0x7F) {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

std::string path_from_json(std::string_view text) {
  if (text.substr(0, kPathBytesMarker.size()) != kPathBytesMarker) return std::string(text);
  text.remove_prefix(kPathBytesMarker.size());
  const auto hex = [](char h) -> int {
    if (h >= '0' && h <= '9') return h - '0';
    if (h >= 'A' && h <= 'F') return h - 'A' + 10;
    if (h >= 'a' && h <= 'f') return h - 'a' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && hex(text[i + 1]) >= 0 && hex(text[i + 2]) >= 0) {
      out += char(hex(text[i + 1]) * 16 + hex(text[i + 2]));
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

}  // namespace dmoe
