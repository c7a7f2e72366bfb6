// dmoe/dmoe.hpp — the whole public surface of the dmoe library in one include.
//
// With the installed package (find_package(dmoe CONFIG), target dmoe::dmoe) the headers live under
// <prefix>/include/dmoe/ in the source tree's layout (dmoe/core/config.hpp, dmoe/engine/reference.hpp, ...);
// the target puts both <prefix>/include and <prefix>/include/dmoe on the include path, so this header,
// the topic headers beside it and the library's own includes ("core/config.hpp") all resolve.
// docs/architecture.md ("The installed library") says why.
#pragma once

#include "dmoe/checkpoint.hpp"
#include "dmoe/comm.hpp"
#include "dmoe/config.hpp"
#include "dmoe/engine.hpp"
#include "dmoe/error.hpp"
