# FindCudnnFrontend: locates cudnn-frontend (NVIDIA's header-only C++ graph API over cuDNN) and cuDNN 9.
#
# cudnn-frontend headers (cudnn_frontend.h): $CUDNN_FRONTEND_HOME (variable or environment; its include/),
# else the PyPI wheel nvidia-cudnn-frontend (pinned in scripts/requirements-gpu.txt) in the Python
# interpreters on PATH. The wheel installs its headers into <site-packages>/include (beside its `cudnn`
# Python package, not inside it), so that is where this looks: the directory holding the package `cudnn`,
# then include/ there. Setting CUDNN_FRONTEND_HOME to a directory without the headers turns the search off
# (it is the only place looked in then): the build falls back to the stub of src/cuda/attention_cudnn.cpp.
#
# cuDNN (cudnn.h, for the types the frontend names, and libcudnn.so.9, which dmoe loads at run time):
# $CUDNN_HOME, the `nvidia.cudnn` package of the Python interpreters on PATH (PyTorch's nvidia-cudnn-cu1x
# wheel: include/ and lib/libcudnn.so.9), the CUDA toolkit, then the system.
#
# Defines CudnnFrontend_FOUND, CUDNN_FRONTEND_INCLUDE_DIR, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY (the shared
# object found at configure time: dmoe does not link it, it dlopens it, and uses this path as the last
# place to try), CUDNN_FRONTEND_VERSION.

# The site-packages directories of the Python interpreters on PATH that hold the Python package `module`
# (found without importing it: the frontend's package loads libcudnn on import).
function(_cudnn_fe_python_dirs module out)
  set(dirs)
  foreach(py python3 python)
    find_program(_cudnn_fe_python NAMES ${py} NO_CACHE)
    if(_cudnn_fe_python)
      execute_process(
        COMMAND ${_cudnn_fe_python} -c
          "import importlib.util as u, os; s = u.find_spec('${module}'); print(os.path.dirname(list(s.submodule_search_locations)[0]))"
        OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
      if(rc EQUAL 0 AND dir)
        list(APPEND dirs ${dir})
      endif()
    endif()
    unset(_cudnn_fe_python CACHE)
  endforeach()
  set(${out} ${dirs} PARENT_SCOPE)
endfunction()

# ---- cudnn-frontend headers ----
if(NOT DEFINED CUDNN_FRONTEND_HOME AND DEFINED ENV{CUDNN_FRONTEND_HOME})
  set(CUDNN_FRONTEND_HOME $ENV{CUDNN_FRONTEND_HOME})
endif()
if(DEFINED CUDNN_FRONTEND_HOME)
  find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h PATHS ${CUDNN_FRONTEND_HOME}
            PATH_SUFFIXES include NO_DEFAULT_PATH)
else()
  _cudnn_fe_python_dirs(cudnn _cudnn_fe_site)
  find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS ${_cudnn_fe_site}
            PATH_SUFFIXES include cudnn/include NO_DEFAULT_PATH)
endif()
if(CUDNN_FRONTEND_INCLUDE_DIR AND EXISTS ${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h)
  file(STRINGS ${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h _cudnn_fe_ver
       REGEX "#define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION [0-9]+")
  string(REGEX REPLACE ".*MAJOR_VERSION ([0-9]+).*MINOR_VERSION ([0-9]+).*PATCH_VERSION ([0-9]+).*" "\\1.\\2.\\3"
         CUDNN_FRONTEND_VERSION "${_cudnn_fe_ver}")
endif()

# ---- cuDNN ----
set(_cudnn_hints)
if(DEFINED CUDNN_HOME)
  list(APPEND _cudnn_hints ${CUDNN_HOME})
elseif(DEFINED ENV{CUDNN_HOME})
  list(APPEND _cudnn_hints $ENV{CUDNN_HOME})
endif()
_cudnn_fe_python_dirs(nvidia _cudnn_nvidia_site)
foreach(dir ${_cudnn_nvidia_site})
  list(APPEND _cudnn_hints ${dir}/nvidia/cudnn)
endforeach()
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _cudnn_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
if(CUDAToolkit_INCLUDE_DIRS)
  list(GET CUDAToolkit_INCLUDE_DIRS 0 _cudnn_cuda_include)
  get_filename_component(_cudnn_cuda_root ${_cudnn_cuda_include} DIRECTORY)
  list(APPEND _cudnn_hints ${_cudnn_cuda_root})
endif()
find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${_cudnn_hints} PATH_SUFFIXES include)
# The wheels ship only the versioned object (libcudnn.so.9).
find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${_cudnn_hints} PATH_SUFFIXES lib lib64)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CudnnFrontend
  REQUIRED_VARS CUDNN_FRONTEND_INCLUDE_DIR CUDNN_INCLUDE_DIR
  VERSION_VAR CUDNN_FRONTEND_VERSION)
mark_as_advanced(CUDNN_FRONTEND_INCLUDE_DIR CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
