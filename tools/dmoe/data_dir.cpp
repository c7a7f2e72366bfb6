#include "data_dir.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/output_file.hpp"
#include "model/config_io.hpp"

// Both are set by the build (CMakeLists.txt, cmake/install.cmake); the defaults are for a build without them.
#ifndef DMOE_SOURCE_DIR
#define DMOE_SOURCE_DIR "."
#endif
#ifndef DMOE_DATA_DIR_FROM_BIN
#define DMOE_DATA_DIR_FROM_BIN "../share/dmoe"
#endif

namespace dmoe::cli {

namespace fs = std::filesystem;

namespace {

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// What a path that is there but no regular file is ("a directory", "a FIFO", ...); "" for a file or nothing.
std::string not_a_file(const fs::path& p) {
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (ec || !fs::exists(st) || fs::is_regular_file(st)) return "";
  if (fs::is_directory(st)) return "a directory";
  if (fs::is_fifo(st)) return "a FIFO";
  if (fs::is_character_file(st) || fs::is_block_file(st)) return "a device";
  if (fs::is_socket(st)) return "a socket";
  return "not a regular file";
}

// The other folder of named configs: a name of one given where the other is read (`init --config tiny`, tiny being a
// model) was "neither a file nor a named config", the model not mentioned.
struct NamedFolder {
  const char* folder;
  const char* what;
  const char* readers;
};
constexpr NamedFolder kNamedConfigFolders[] = {
    {"bench/configs", "config", "init, run and bench layer"},
    {"bench/models", "model config", "init-model, train, eval, bench model and flow measure / project"},
};

}  // namespace

std::vector<DataRoot> data_roots() {
  std::vector<DataRoot> roots;
  if (const char* home = std::getenv("DMOE_HOME"); home && *home) {
    DMOE_REQUIRE_INPUT(is_dir(home),
                       "DMOE_HOME='{}' is not a directory: it must name a folder holding bench/ (a dmoe source "
                       "tree, or an install's <prefix>/share/dmoe); unset it to use the data installed beside the "
                       "dmoe executable",
                       home);
    // A folder without bench/ was passed over without a word: the named configs came from the next place.
    DMOE_REQUIRE_INPUT(is_dir(fs::path(home) / "bench"),
                       "DMOE_HOME='{}' has no bench/ folder: it must name a folder holding bench/ (a dmoe source tree, "
                       "or an install's <prefix>/share/dmoe); unset it to use the data installed beside the dmoe "
                       "executable", home);
    roots.push_back({home, "$DMOE_HOME"});
  }
  // One folder reached twice (DMOE_HOME set to the source tree) is one place, listed once with both origins.
  const auto add = [&](const std::string& path, const std::string& origin) {
    for (DataRoot& r : roots)
      if (is_dir(path) && is_dir(r.path) && same_file(r.path, path)) {
        r.origin += "; also " + origin;
        return;
      }
    roots.push_back({path, origin});
  };
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && !exe.empty()) {
    const fs::path data = (exe.parent_path() / DMOE_DATA_DIR_FROM_BIN).lexically_normal();
    add(data.string(), "the install's data folder, beside " + exe.string());
  }
  add(DMOE_SOURCE_DIR, "the source tree dmoe was built from");
  return roots;
}

std::string find_data_file(const std::vector<DataRoot>& roots, const std::string& relative) {
  for (const DataRoot& r : roots) {
    const fs::path p = fs::path(r.path) / relative;
    if (is_file(p)) return p.string();
  }
  return "";
}

std::vector<std::string> data_file_names(const std::vector<DataRoot>& roots, const std::string& folder,
                                         const std::string& extension) {
  std::set<std::string> names;
  for (const DataRoot& r : roots) {
    const fs::path dir = fs::path(r.path) / folder;
    if (!is_dir(dir)) continue;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().extension() == extension && is_file(it->path())) names.insert(it->path().stem().string());
  }
  return {names.begin(), names.end()};
}

std::string describe_search(const std::vector<DataRoot>& roots, const std::string& relative) {
  std::string out;
  if (const char* home = std::getenv("DMOE_HOME"); !home || !*home)
    out += "\n  ($DMOE_HOME, searched first, is not set)";
  for (const DataRoot& r : roots) {
    const fs::path p = fs::path(r.path) / relative;
    std::string why;
    if (!is_dir(r.path))
      why = ": no such folder";
    else if (!is_dir(fs::path(r.path) / "bench"))
      why = ": it has no bench/ folder";
    else if (const std::string kind = not_a_file(p); !kind.empty())
      why = ": there, but " + kind + ", not a regular file";
    else if (!is_file(p))
      why = ": not there";
    out += fmt::format("\n  {} ({}{})", p.string(), r.origin, why);
  }
  return out;
}

std::string named_json_shadowed_by(const std::string& name, const std::string& folder) {
  if (name.empty() || name.find('/') != std::string::npos || fs::path(name).extension() == ".json") return "";
  return find_data_file(data_roots(), folder + "/" + name + ".json");
}

std::string find_named_json(const std::string& name, const std::string& folder, const std::string& what) {
  std::error_code ec;
  if (fs::exists(name, ec)) {
    // A directory of that name in the current directory (say, one made for the outputs: `mkdir cpu-small`) hid the
    // named file: "config file 'cpu-small' is a directory; expected a JSON file", the named one not mentioned.
    const bool directory = fs::is_directory(name, ec);
    const std::string named = named_json_shadowed_by(name, folder);
    DMOE_REQUIRE_INPUT(!directory || named.empty(), "{} '{}' is a directory in the current directory, which is read "
                       "before the named {}s (and is no JSON file); the named {} '{}' is {}: give that path to use it",
                       what, name, what, what, name, named);
    // A file of that name (notes, a log, a download) likewise: its parse error alone ("model config 'tiny': not valid
    // JSON") did not say that a named config of the name exists, nor how to reach it. Read here only in that case
    // (configs are kilobytes); a file that parses is taken, as it was.
    if (!named.empty()) {
      try {
        (void)read_json_file(name, what);
      } catch (const Error& e) {
        if (!e.is_input()) throw;
        DMOE_FAIL_INPUT("{}\nThat is the file '{}' in the current directory, which is read before the named {}s; the "
                        "named {} '{}' is {}: give that path to use it (or rename the file)", e.what(), name, what,
                        what, name, named);
      }
    }
    return name;
  }
  // A path that is there but cannot be followed (a symbolic link loop, a part of it not searchable) was looked up as
  // a named file, and the error listed the search places as if nothing were there (or, for a model config, ended in
  // "unexpected error: filesystem error", rc 2).
  std::error_code link_ec;
  DMOE_REQUIRE_INPUT(!ec || ec == std::errc::no_such_file_or_directory || !fs::exists(fs::symlink_status(name, link_ec)),
                     "{} '{}' cannot be read: {}{}", what, name, ec.message(),
                     fs::is_symlink(fs::symlink_status(name, link_ec)) ? " (it is a symbolic link)" : "");
  DMOE_REQUIRE_INPUT(!name.empty(), "{}: an empty name is neither a file nor a named {}", what, what);
  // A path (a '/' in it, or a .json name) is not looked up among the named files: the caller's reader
  // reports it missing, naming its option.
  if (name.find('/') != std::string::npos || fs::path(name).extension() == ".json") return name;
  const std::vector<DataRoot> roots = data_roots();
  const std::string relative = folder + "/" + name + ".json";
  const std::string found = find_data_file(roots, relative);
  if (!found.empty()) return found;
  const std::vector<std::string> names = data_file_names(roots, folder, ".json");
  std::string available;
  for (const std::string& n : names) available += (available.empty() ? "" : ", ") + n;
  // Only between the two config folders (a cost or cluster file has no other kind).
  const bool config_folder = std::any_of(std::begin(kNamedConfigFolders), std::end(kNamedConfigFolders),
                                         [&](const NamedFolder& f) { return folder == f.folder; });
  std::string elsewhere;
  for (const NamedFolder& f : kNamedConfigFolders) {
    if (!config_folder || folder == f.folder) continue;
    if (const std::string other = find_data_file(roots, std::string(f.folder) + "/" + name + ".json"); !other.empty())
      elsewhere = fmt::format("\n'{}' is a named {} ({}), which {} read", name, f.what, other, f.readers);
  }
  DMOE_FAIL_INPUT("{} '{}' is neither a file nor a named {}; looked for it in, in this order:{}{}\n{}",
                  what, name, what, describe_search(roots, relative), elsewhere,
                  names.empty() ? "no named " + what + "s were found in any of these places: set DMOE_HOME to a "
                                      "folder holding bench/ (a dmoe source tree or an install's share/dmoe)"
                                : "named " + what + "s there: " + available);
}

}  // namespace dmoe::cli
