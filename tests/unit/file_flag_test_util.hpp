// file_flag_test_util.hpp — setting a file's attributes (chattr) in tests: append-only directories, immutable files.
#pragma once

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <string>

namespace dmoe::test {

// Sets or clears an attribute flag (FS_APPEND_FL, FS_IMMUTABLE_FL ...) of `path`; false where the file system or this
// user may not.
inline bool set_file_flag(const std::string& path, int flag, bool on) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  int flags = 0;
  bool ok = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  flags = on ? flags | flag : flags & ~flag;
  ok = ok && ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  ::close(fd);
  return ok;
}

}  // namespace dmoe::test
