// output_file.hpp — every file dmoe writes goes through here: checked up front, written atomically.
//
// Policy (README, "Output files"):
//   - a new path, or an existing regular file: the bytes go to a temporary file in the same directory
//     (every write, the fsync and the close checked), which is then renamed over the target, so the
//     target holds the old content or the whole new content, never a part; a failed write removes the
//     temporary and leaves the old file untouched. An existing file keeps its permission bits; other
//     hard links to it keep the old content (the name now points to a new file).
//   - a symbolic link: resolved, and its final target is replaced as above (the link stays a link); a
//     link whose target does not exist is refused.
//   - anything else (directory, FIFO, character or block device, socket): refused with an error naming
//     the path, what it is, and what is allowed. /dev/full, /dev/null and pipes are therefore errors.
//   - a terminating signal sent from outside (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM,
//     SIGPROF, SIGXCPU, SIGXFSZ, SIGPIPE, SIGIO, SIGPWR, SIGSTKFLT and SIGRTMIN..SIGRTMAX; each only where it is at its default disposition, not ignored or handled by
//     someone else) that ends the process while a temporary exists removes it first; the process then ends by the
//     signal as before (SIGKILL cannot be caught: it may leave one).
//   - an output that is the same file as one of the command's inputs (same device and inode, so hard
//     links, symlinks and "./x" vs "x" count as the same file) is refused before anything runs.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dmoe {

class GrowingOutputFile;

// One file a command reads or writes, with the option that named it ("--input").
struct NamedPath {
  std::string option;
  std::string path;
};

// Checks, before any long work, that write_file_atomically(path, …) can succeed as far as the file
// system can tell: the target is a regular file, a symlink to one, or a new name in an existing
// directory where a temporary file can be created (one is created and removed), and an existing file is one the
// rename can replace: not immutable or append-only, not a mount point (a bind-mounted file: EBUSY), not another user's
// file in a sticky directory such as /tmp (EPERM, unless this process has CAP_FOWNER), writable by this user.
// `option` (e.g. "--output") is named in the error.
void check_output_file(const std::string& path, std::string_view option);

// The check for an existing file that is written in place, appended to and cut back (GrowingOutputFile with append:
// a resumed run's --log), never renamed: a regular file (or a link to one) this process can open for writing. A
// mount point or another user's shared file in a sticky directory is fine here; check_output_file refused them for a
// rename that never comes (G21-5, twenty-first pass).
void check_appended_output_file(const std::string& path, std::string_view option);

// The terminating signals of the policy above (INT, TERM, HUP, QUIT, USR1, USR2, ALRM, VTALRM, PROF, XCPU, XFSZ, PIPE,
// IO, PWR, STKFLT, SIGRTMIN..SIGRTMAX): every signal whose default action ends the process and that comes from outside
// it. `dmoe launch` forwards the same set to its ranks (G22B-1).
const std::vector<int>& cleaned_signals();

// Writes `bytes` to `path` under the policy above; throws dmoe::Error naming the path and the cause.
void write_file_atomically(const std::string& path, std::span<const uint8_t> bytes);
void write_file_atomically(const std::string& path, std::string_view text);

// Several outputs that appear together or not at all: write() puts each file's bytes in its temporary
// (checked as above), commit() renames them all onto their targets, holding back those signals (above) until
// the last rename (the process then ends by the signal). A failed write(), or destruction without commit(), removes
// every temporary of the set and leaves all targets untouched. commit() first checks every target as check_output_file
// does for the rename (a mount point, a sticky directory): one that cannot be replaced fails the set before any rename.
// A rename that fails anyway part-way undoes the set: each file a later rename could leave replaced is hard-linked to a
// backup ".NAME.dmoe-old.PID.N" beside it first, and the files already replaced are put back from their backups (the
// files the set created removed), so the error leaves every target as it was; the backups are removed when the commit
// ends. (Where no backup could be linked and a journal is given, the journal and the remaining temporaries are kept
// instead, for finish_interrupted_commit to complete once the cause is gone.)
// SIGKILL (or a power cut) cannot be held back: with a `journal` path, commit() first writes there which temporary
// goes onto which target (atomically, after every temporary is complete), then renames, then removes the journal, so
// that finish_interrupted_commit(journal) can complete a commit that was killed between two renames.
// `publish`: a GrowingOutputFile not yet published (a new run's --log) whose rename is the commit's last, journaled
// with the others (by its option, as absolute paths: it is outside the journal's directory); once committed it is
// published (its pieces go on into the same file under the target's name). Null, or one already published: nothing.
class OutputFileSet {
 public:
  OutputFileSet() = default;
  OutputFileSet(const OutputFileSet&) = delete;
  OutputFileSet& operator=(const OutputFileSet&) = delete;
  ~OutputFileSet();

  void write(const std::string& path, std::span<const uint8_t> bytes);
  void write(const std::string& path, std::string_view text);
  // A file the commit removes once every file of the set is in place, before a signal held back during the renames
  // ends the process (a failure to remove it leaves it; a set that is not committed removes nothing). A replaced
  // index's old shards were removed after commit() returned, so a SIGTERM during the renames ended the process first
  // and left them beside the new model (G19-4 of the nineteenth bad-input pass).
  void remove_after_commit(const std::string& path);
  void commit(const std::string& journal = {}, GrowingOutputFile* publish = nullptr);

 private:
  struct Written {
    std::string path, temporary, target, directory;
    int slot;  // its entry for the signal handler that removes temporaries (output_file.cpp)
  };
  void discard();
  std::vector<Written> written_;
  std::vector<std::string> removed_after_commit_;
};

// Completes a commit that ended between its journal and its last rename (a SIGKILL, an out-of-memory kill, a power
// cut): every temporary the journal names that still exists is renamed onto its target, the commit's backups of the
// replaced files removed, then the journal removed.
// Returns the targets completed ("" when there was no journal, or nothing left to do). A journal that cannot be read,
// or a rename that fails, throws naming the journal (the files are left as they are).
// A journaled file of an option (OutputFileSet::commit's `publish`, outside the journal's directory) is completed only
// onto this command's own output of that option in `outputs`, and only where that is the same file the commit was
// replacing and the temporary is dmoe's, beside it; a journal can then move no file the command was not told to
// write. Another file, or one changed since, throws (nothing renamed, the journal kept). Where `outputs` has no such
// option, that entry is left as it is and `left` (when given) says where its content is, for a note.
std::string finish_interrupted_commit(const std::string& journal, const std::vector<NamedPath>& outputs = {},
                                      std::string* left = nullptr, std::string* failure = nullptr);
// (`failure`, when given: "" for a commit that was killed between its renames, or, for one whose rename failed and
// that could not be undone, what failed, as the commit recorded it in its journal.)

// Tests only: called after each rename of OutputFileSet::commit (a signal sent there must wait for the last one).
void set_after_rename_hook_for_tests(void (*hook)(size_t renamed_index));
// Tests only: where `fail(target)` is true, the commit's backup link of that target fails (EPERM), as on a file system
// without hard links.
void set_backup_link_failure_for_tests(bool (*fail)(const std::string& target));

// A file that grows piece by piece (a training log) under the same policy. Checked as check_output_file; a new file's
// pieces go to a temporary beside the target (a name of dmoe's own, created exclusively, removed on the signals above
// and when the object is destroyed unpublished), and publish() renames it over the target (or a commit does, as
// the last of its files: OutputFileSet::commit's `publish`), after which the pieces go on into the same file under the
// target's name. Until then the target keeps its earlier content: a run that fails before it publishes leaves the
// earlier file as it was. `append`: the target itself is opened for appending
// (it must exist; a resumed run's log), and counts as published. Where no file is at the target there is nothing to
// keep: the first write publishes. A write that fails (disk full, a file size limit)
// is cut back to the end of the piece before it, so the file never ends in a part of a piece, and throws naming the
// option, the path and whether the earlier content is still there.
class GrowingOutputFile {
 public:
  GrowingOutputFile(const std::string& path, std::string_view option, bool append);
  GrowingOutputFile(const GrowingOutputFile&) = delete;
  GrowingOutputFile& operator=(const GrowingOutputFile&) = delete;
  ~GrowingOutputFile();

  // `what`: which piece, for the error ("step 12").
  void write(std::string_view piece, std::string_view what = {});
  void publish();  // the first call renames the temporary over the target; later calls do nothing
  bool published() const { return published_; }
  // Cuts the file back to its first `bytes` bytes (a resumed run drops the lines past its checkpoint).
  void truncate(uint64_t bytes);
  void close();  // checked; done by the destructor too (unchecked there)

 private:
  friend class OutputFileSet;  // commit(journal, publish) renames the temporary as one of the set's files
  std::string path_, option_, target_, directory_, temporary_;
  int fd_ = -1, slot_ = -1;
  uint64_t size_ = 0;
  bool published_ = false;
  bool replaces_ = false;  // an earlier file is at the target (else the first write publishes)
};

// An exclusive advisory lock (flock) that one dmoe process holds while it writes a set of files: on a directory (opened
// read-only) or on a lock file (created if missing and never removed: removing it would let a third process lock a new
// file while a second still holds the old one). Released when the object is destroyed, or when the process ends
// however it ends. On a file system without flock (some network ones) there is no lock, as before.
class ExclusiveLock {
 public:
  ExclusiveLock() = default;
  ExclusiveLock(const ExclusiveLock&) = delete;
  ExclusiveLock& operator=(const ExclusiveLock&) = delete;
  ~ExclusiveLock();
  // false when another process holds it and `wait` is false (true once locked, or where locks are not supported);
  // a path that cannot be opened throws an input error naming `what` and the path.
  bool lock_directory(const std::string& directory, std::string_view what, bool wait);
  bool lock_file(const std::string& path, std::string_view what, bool wait);
  enum class Outcome { held, busy, unavailable };
  // A lock file that exists only while it is held (no hidden file left beside a user's output): created when missing,
  // locked without waiting (busy when another process holds it), and removed by its holder, still locked, when the
  // object is destroyed or a terminating signal ends the process (the temporaries' handler). A process that opened the
  // file just before its holder removed it finds, once locked, that the name is no longer its file, and takes the new
  // one instead, so two processes never both hold "the" lock. SIGKILL leaves the file, empty; the next holder takes it
  // over and removes it. Only an empty regular file is taken over: anything else at the name (a user's file that
  // happens to bear it, a link, a directory) is an input error naming it, never locked or removed (G23A-2). One that
  // cannot be created (EACCES, EPERM, EROFS: a directory this process may not write) is `unavailable`, `why` saying so;
  // any other failure (EIO) is an error.
  Outcome lock_transient_file(const std::string& path, std::string_view what, std::string* why = nullptr);
  // An exclusive lock on an existing file itself (opened read-only, links followed): it holds through every name of
  // the file (hard links), as long as the file is not replaced. busy when another process holds it; unavailable when
  // it cannot be opened.
  Outcome lock_existing_file(const std::string& path);

 private:
  bool lock(bool wait);
  int fd_ = -1;
  std::string transient_path_;  // lock_transient_file's name, removed by the destructor
  int transient_slot_ = -1;     // its entry in the signal handler's table
};

// True when a and b name the same file: same (st_dev, st_ino) when both exist (symlinks followed); false when only one
// exists; when neither does, the same name in the same directory: the path as given split at its last '/', and the
// directories' identities compared as the kernel resolves them ("lnk/.." is the parent of lnk's target, not "."; a
// working directory deeper than PATH_MAX, where paths cannot be made absolute, is no obstacle), else (a directory
// missing too) the same absolute path, its existing part resolved (links followed) and the rest normalised.
bool same_file(const std::string& a, const std::string& b);

// Refuses an output that is the same file as an input or as another output, naming both options.
// Empty paths are skipped.
void require_distinct_files(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs);

}  // namespace dmoe

namespace dmoe {

// A path (or any text holding one) as a JSON string that dumps without error and reads back to the same bytes. JSON
// strings are UTF-8, and nlohmann's dump throws type_error 316 on any other byte: a path that is not UTF-8 (a Latin-1
// file name, `$'d\xff.txt'`) given to `train --data`, `--log` over an existing log, or flow's `--costs`/`--config`/
// `--cluster` ended the command after all its work, with nothing written (G21-1, twenty-first pass). A UTF-8 path is
// kept as it is; any other (and one that begins with the marker itself) is written as "dmoe-bytes:" and its bytes
// percent-escaped ('%', control and non-ASCII bytes as %XX), which path_from_json turns back into the exact bytes.
std::string path_for_json(std::string_view path);
std::string path_from_json(std::string_view text);
// True when `text` is valid UTF-8 as nlohmann's dump requires it.
bool is_utf8(std::string_view text);

}  // namespace dmoe
