# The pybind11 module fusedamp._C: bindings of the C++ engine (csrc/python/). Built with the
# pybind11 headers and tensor casters that ship with torch (torch/csrc/utils/pybind.h), against
# libtorch_python, with torch's pybind11 ABI tags so objects cross module boundaries as torch
# expects.
find_package(Python3 COMPONENTS Interpreter Development.Module REQUIRED)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import torch; print(';'.join(getattr(torch._C, '_PYBIND11_' + k, None) or '' for k in ('COMPILER_TYPE', 'STDLIB', 'BUILD_ABI')))"
  OUTPUT_VARIABLE _pybind_abi OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
Python3_add_library(fusedamp_python MODULE WITH_SOABI ${FUSEDAMP_PYTHON_SOURCES})
set_target_properties(fusedamp_python PROPERTIES
  OUTPUT_NAME _C
  INSTALL_RPATH "$ORIGIN/${CMAKE_INSTALL_LIBDIR};${TORCH_INSTALL_PREFIX}/lib"
  BUILD_RPATH "${CMAKE_CURRENT_BINARY_DIR};${TORCH_INSTALL_PREFIX}/lib")
target_link_libraries(fusedamp_python PRIVATE fusedamp "${TORCH_INSTALL_PREFIX}/lib/libtorch_python.so")
target_compile_definitions(fusedamp_python PRIVATE TORCH_EXTENSION_NAME=_C)
# One translation unit for all bindings: what each file costs is parsing torch's and pybind11's
# headers and instantiating their templates, which one unit does once. They include
# torch/csrc/utils/pybind.h, not torch/extension.h, whose C++ frontend (torch/all.h) they do
# not use: the unit compiles in 13 CPU-seconds instead of 35 (2-core Xeon, -O3). Names at
# namespace scope must be unique across csrc/python/*.cpp.
set_target_properties(fusedamp_python PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
if(_rc EQUAL 0)
  list(GET _pybind_abi 0 _ct)
  list(GET _pybind_abi 1 _stdlib)
  list(GET _pybind_abi 2 _abi)
  if(_ct)
    target_compile_definitions(fusedamp_python PRIVATE PYBIND11_COMPILER_TYPE="${_ct}")
  endif()
  if(_stdlib)
    target_compile_definitions(fusedamp_python PRIVATE PYBIND11_STDLIB="${_stdlib}")
  endif()
  if(_abi)
    target_compile_definitions(fusedamp_python PRIVATE PYBIND11_BUILD_ABI="${_abi}")
  endif()
endif()
# Installed into the package directory itself (the install prefix is the package when built
# by setup.py or the Makefile).
install(TARGETS fusedamp_python LIBRARY DESTINATION . COMPONENT python)
if(FUSEDAMP_WITH_CUDA)
  target_compile_definitions(fusedamp_python PRIVATE FUSEDAMP_WITH_CUDA)
endif()
