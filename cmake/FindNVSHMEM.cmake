# FindNVSHMEM: locates NVSHMEM (host library, device library, headers).
#
# Looks in, in order: $NVSHMEM_HOME, the `nvidia.nvshmem` package of the Python interpreters on PATH
# (the PyPI wheel nvidia-nvshmem-cu13, pinned in scripts/requirements-gpu.txt), and /usr.
# The wheel ships only versioned shared objects (libnvshmem_host.so.3), so the library is searched by
# that exact name as well.
#
# Defines NVSHMEM_FOUND, NVSHMEM_INCLUDE_DIR, NVSHMEM_HOST_LIBRARY, NVSHMEM_DEVICE_LIBRARY,
# NVSHMEM_LIB_DIR and the imported targets NVSHMEM::host and NVSHMEM::device.
set(_nvshmem_hints)
if(DEFINED ENV{NVSHMEM_HOME})
  list(APPEND _nvshmem_hints $ENV{NVSHMEM_HOME})
endif()
foreach(_py python3 python)
  find_program(_nvshmem_python NAMES ${_py} NO_CACHE)
  if(_nvshmem_python)
    execute_process(
      COMMAND ${_nvshmem_python} -c "import nvidia.nvshmem as m; print(m.__path__[0])"
      OUTPUT_VARIABLE _nvshmem_py_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND _nvshmem_py_dir)
      list(APPEND _nvshmem_hints ${_nvshmem_py_dir})
    endif()
  endif()
  unset(_nvshmem_python CACHE)
endforeach()
list(APPEND _nvshmem_hints /usr/local/nvshmem /usr)

find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_nvshmem_hints} PATH_SUFFIXES include include/nvshmem)
find_library(NVSHMEM_HOST_LIBRARY NAMES nvshmem_host libnvshmem_host.so.3
             HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64)
find_library(NVSHMEM_DEVICE_LIBRARY NAMES nvshmem_device libnvshmem_device.a
             HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM
  REQUIRED_VARS NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY NVSHMEM_DEVICE_LIBRARY)

if(NVSHMEM_FOUND)
  get_filename_component(NVSHMEM_LIB_DIR ${NVSHMEM_HOST_LIBRARY} DIRECTORY)
  if(NOT TARGET NVSHMEM::host)
    add_library(NVSHMEM::host SHARED IMPORTED)
    set_target_properties(NVSHMEM::host PROPERTIES
      IMPORTED_LOCATION ${NVSHMEM_HOST_LIBRARY}
      IMPORTED_NO_SONAME FALSE
      INTERFACE_INCLUDE_DIRECTORIES ${NVSHMEM_INCLUDE_DIR})
    add_library(NVSHMEM::device STATIC IMPORTED)
    set_target_properties(NVSHMEM::device PROPERTIES
      IMPORTED_LOCATION ${NVSHMEM_DEVICE_LIBRARY}
      INTERFACE_INCLUDE_DIRECTORIES ${NVSHMEM_INCLUDE_DIR})
  endif()
endif()
mark_as_advanced(NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY NVSHMEM_DEVICE_LIBRARY)
