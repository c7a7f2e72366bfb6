# install.cmake — what `cmake --install <build> [--prefix P]` puts where, and the CMake package that
# find_package(dmoe CONFIG) loads (docs/architecture.md, "The installed library"; README, "C++ consumer").
#
#   P/bin/dmoe                       the tool; finds its data through /proc/self/exe (tools/dmoe/data_dir.hpp)
#   P/share/dmoe/bench/...           named configs (configs/, models/, flow/ *.json) and peers.py
#   P/lib/libdmoe.a                  the library (CUDA objects in it when the build had CUDA)
#   P/include/dmoe/dmoe.hpp          the umbrella header, and the topic headers beside it
#   P/include/dmoe/<layer>/*.hpp     src/'s headers in their source layout (core/, engine/, comm/, model/, ...)
#   P/lib/cmake/dmoe/                dmoeConfig.cmake, its version file, dmoeTargets.cmake, FindNVSHMEM.cmake
#
# Two install components, so that a packager can take one (e.g. a Python wheel build that installs only
# its own module): dmoe_tool (bin/ and share/) and dmoe_dev (lib/, include/, the CMake package). A plain
# `cmake --install` installs both.
#
# Included once from CMakeLists.txt after the targets `dmoe` and `dmoe_cli` exist.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DMOE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/dmoe)
set(DMOE_INSTALL_DATADIR ${CMAKE_INSTALL_DATADIR}/dmoe)
set(DMOE_INSTALL_HEADERDIR ${CMAKE_INSTALL_INCLUDEDIR}/dmoe)

# An installed static library gets linked into shared objects too (the Python extension module, a
# consumer's plugin), so its code is position-independent.
set_target_properties(dmoe PROPERTIES POSITION_INDEPENDENT_CODE ON)
# The headers are C++20 (std::span, among others): a consumer compiles them as such.
target_compile_features(dmoe PUBLIC cxx_std_20)

# ---- the tool and its data -------------------------------------------------------------------------
# The tool looks for its data at <dir of the executable>/<this path>. Both folders are relative to the
# prefix by default, so the path holds for any --prefix given at install time and for a moved install.
file(RELATIVE_PATH _dmoe_data_from_bin ${CMAKE_INSTALL_FULL_BINDIR} ${CMAKE_INSTALL_FULL_DATADIR}/dmoe)
target_compile_definitions(dmoe_cli PRIVATE DMOE_DATA_DIR_FROM_BIN="${_dmoe_data_from_bin}")
# The libraries found outside the build (cuBLAS, NCCL, NVSHMEM's wheel in site-packages) stay on the
# installed binary's RPATH, which CMake would otherwise clear at install.
set_target_properties(dmoe_cli PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
install(TARGETS dmoe_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT dmoe_tool)
install(DIRECTORY bench/configs bench/models bench/flow DESTINATION ${DMOE_INSTALL_DATADIR}/bench
        COMPONENT dmoe_tool FILES_MATCHING PATTERN "*.json")
install(PROGRAMS bench/peers.py DESTINATION ${DMOE_INSTALL_DATADIR}/bench COMPONENT dmoe_tool)

# ---- the library and its headers ------------------------------------------------------------------
# Headers keep their source layout under include/dmoe/, so their own includes ("core/config.hpp") resolve
# through include/dmoe on the include path, and <dmoe/dmoe.hpp> through include/.
install(TARGETS dmoe EXPORT dmoeTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dmoe_dev
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${DMOE_INSTALL_HEADERDIR})
install(DIRECTORY include/dmoe/ DESTINATION ${DMOE_INSTALL_HEADERDIR} COMPONENT dmoe_dev
        FILES_MATCHING PATTERN "*.hpp")
# The folders compiled only with CUDA ship their headers only then (a CPU-only install has no such code).
set(_dmoe_cuda_only_dirs cuda comm/cuda bench/cuda flash model/cuda)
set(_dmoe_header_excludes)
if(NOT DMOE_WITH_CUDA)
  foreach(_d IN LISTS _dmoe_cuda_only_dirs)
    list(APPEND _dmoe_header_excludes REGEX "/src/${_d}(/|$)" EXCLUDE)
  endforeach()
endif()
install(DIRECTORY src/ DESTINATION ${DMOE_INSTALL_HEADERDIR} COMPONENT dmoe_dev
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.cuh" ${_dmoe_header_excludes})

# ---- the CMake package -----------------------------------------------------------------------------
# What the build found, for the package to find the same dependencies again (dmoeConfig.cmake.in).
set(DMOE_PACKAGE_WITH_NVSHMEM OFF)
set(DMOE_PACKAGE_CUDA_ROOT "")
set(DMOE_PACKAGE_NCCL_LIB_DIR "")
set(DMOE_PACKAGE_NCCL_INCLUDE_DIR "")
if(DMOE_WITH_CUDA)
  get_filename_component(DMOE_PACKAGE_CUDA_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  if(DMOE_NCCL_LIB)
    get_filename_component(DMOE_PACKAGE_NCCL_LIB_DIR "${DMOE_NCCL_LIB}" DIRECTORY)
  endif()
  find_path(DMOE_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} "${DMOE_PACKAGE_NCCL_LIB_DIR}/../include")
  if(DMOE_NCCL_INCLUDE_DIR)
    set(DMOE_PACKAGE_NCCL_INCLUDE_DIR "${DMOE_NCCL_INCLUDE_DIR}")
  endif()
  if(NVSHMEM_FOUND)
    set(DMOE_PACKAGE_WITH_NVSHMEM ON)
  endif()
endif()

install(EXPORT dmoeTargets NAMESPACE dmoe:: DESTINATION ${DMOE_INSTALL_CMAKEDIR} COMPONENT dmoe_dev)
configure_package_config_file(cmake/dmoeConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/dmoeConfig.cmake
                              INSTALL_DESTINATION ${DMOE_INSTALL_CMAKEDIR}
                              PATH_VARS DMOE_INSTALL_DATADIR CMAKE_INSTALL_BINDIR)
# 0.x: a new minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/dmoeConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dmoeConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/dmoeConfigVersion.cmake
              cmake/FindNVSHMEM.cmake
        DESTINATION ${DMOE_INSTALL_CMAKEDIR} COMPONENT dmoe_dev)
