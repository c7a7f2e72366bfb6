// data_dir.hpp — where the dmoe tool finds the data it ships: the named configs (bench/configs/NAME.json),
// named models (bench/models/NAME.json), Flow cost files (bench/flow/NAME.json) and bench/peers.py.
//
// A data root is a folder that holds bench/. They are searched in this order:
//   1. $DMOE_HOME, when set (a dmoe source tree, or an install's <prefix>/share/dmoe);
//   2. the install's data folder next to the running executable: /proc/self/exe is <prefix>/bin/dmoe,
//      the data is <prefix>/share/dmoe (the relative path from bin/ to it is compiled in, from
//      CMAKE_INSTALL_BINDIR and CMAKE_INSTALL_DATADIR);
//   3. the source tree the binary was built from (compiled in), for a binary run from its build folder.
#pragma once

#include <string>
#include <vector>

namespace dmoe::cli {

struct DataRoot {
  std::string path;    // the folder that should hold bench/
  std::string origin;  // why it is searched: "$DMOE_HOME", "the install's data folder, beside ...", ...
};

// The roots in search order. A DMOE_HOME that is set but not a directory is a bad-input error: it was
// meant to be used, and silently falling back to another copy of the data would hide the mistake.
std::vector<DataRoot> data_roots();

// The first root's `relative` (e.g. "bench/configs/mixtral.json") that is a regular file; "" if none.
std::string find_data_file(const std::vector<DataRoot>& roots, const std::string& relative);

// Names (file stems) of the `extension` files in `folder` (e.g. "bench/configs", ".json") over all roots,
// sorted, each once.
std::vector<std::string> data_file_names(const std::vector<DataRoot>& roots, const std::string& folder,
                                         const std::string& extension);

// "where it looked", for errors: one line per root, "\n  <root>/<relative> (origin[: why not])", after a line
// saying that $DMOE_HOME is not set when it is not.
std::string describe_search(const std::vector<DataRoot>& roots, const std::string& relative);

// `name` itself when it is a file or looks like a path (a '/' in it, or a .json ending: the caller's
// reader then says it is missing), else <root>/<folder>/<name>.json in the first root that has it. A name
// found nowhere is a bad-input error saying what `what` is ("config", "model config"), listing every
// place looked at and the names available.
std::string find_named_json(const std::string& name, const std::string& folder, const std::string& what);
// The named file bench/FOLDER/NAME.json that a path NAME in the current directory hides ("" if NAME is a path with a
// '/' or a .json ending, or no named file has that name).
std::string named_json_shadowed_by(const std::string& name, const std::string& folder);

}  // namespace dmoe::cli
