# ccache, where installed, for the C++ and CUDA compiles: an unchanged file in a new build
# folder (make clean, another branch, pip's own build folder) costs a cache lookup instead of
# a compile. A launcher the user chose (CMAKE_<LANG>_COMPILER_LAUNCHER) is kept.
option(FUSEDAMP_CCACHE "Compile through ccache when it is installed" ON)
if(FUSEDAMP_CCACHE)
  find_program(FUSEDAMP_CCACHE_PROGRAM ccache)
  mark_as_advanced(FUSEDAMP_CCACHE_PROGRAM)
endif()
if(FUSEDAMP_CCACHE AND FUSEDAMP_CCACHE_PROGRAM)
  # With precompiled headers (FusedampPrecompiledHeaders.cmake) ccache must be told that
  # it cannot see __TIME__ or #defines through them, else it compiles every file uncached.
  set(_launcher "${CMAKE_COMMAND}" -E env
      "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
      "${FUSEDAMP_CCACHE_PROGRAM}")
  set(_langs "")
  foreach(lang IN ITEMS CXX CUDA)
    if(NOT CMAKE_${lang}_COMPILER_LAUNCHER AND NOT DEFINED ENV{CMAKE_${lang}_COMPILER_LAUNCHER})
      set(CMAKE_${lang}_COMPILER_LAUNCHER ${_launcher})
      list(APPEND _langs ${lang})
    endif()
  endforeach()
  if(_langs)
    message(STATUS "fusedamp: ${_langs} compiled through ${FUSEDAMP_CCACHE_PROGRAM}")
  endif()
endif()
