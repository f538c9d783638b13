# fusedamp_precompile_headers(<target> <header>...)
# Precompiles the named system headers (torch's: written as in #include <...>) for the C++
# files of <target>: the target parses them once and each of its files loads the result.
# Worth it where many files share heavy headers and little else: libfusedamp's ~24 C++ files
# (ATen, the dispatcher, torch's optimizer and serialization headers) went from ~21 to ~8
# CPU-seconds each at -O3, for one 53 s precompile (a 500 MB file). Measured not worth it
# (and not used) for the CPU kernels (their templates, not the headers, are the cost: a 15 s
# precompile per instruction set saved 0-5 s per file), for the three Catch2 test files (a 51 s
# precompile saved 53 s) and for the pybind11 module (a precompile saves only the parsing;
# it is one unity translation unit instead, cmake/FusedampPython.cmake).
# Only headers that change with torch belong here: a project header would rebuild every file
# of the target when it changes. CUDA files are left alone (nvcc takes no precompiled headers).
option(FUSEDAMP_PRECOMPILE_HEADERS "Precompile torch's headers for each C++ target (faster builds)" ON)

function(fusedamp_precompile_headers target)
  if(NOT FUSEDAMP_PRECOMPILE_HEADERS)
    return()
  endif()
  set(headers "")
  foreach(h IN LISTS ARGN)
    list(APPEND headers "$<$<COMPILE_LANGUAGE:CXX>:<${h}$<ANGLE-R>>")
  endforeach()
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()
