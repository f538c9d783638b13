# fusedamp_choose_cuda_architectures(<out-var>)
# Order of precedence: CMAKE_CUDA_ARCHITECTURES given by the user, TORCH_CUDA_ARCH_LIST
# (cache variable or environment, torch's "8.0;8.6;9.0+PTX" form), the local GPUs as reported
# by nvidia-smi, else FUSEDAMP_CUDA_ARCH_LIST_WITHOUT_GPU.
#
# Without a GPU nothing runs the kernels, so what a build needs then depends on who it is for:
# a wheel (setup.py) is for other machines and keeps the release list; the Makefile's test
# build only compiles them (and CI reads ptxas's register report), so it sets one architecture.
# Every architecture is a full device compile of each .cu file.
set(FUSEDAMP_CUDA_ARCH_LIST_WITHOUT_GPU "8.0;8.6;8.9;9.0;10.0;12.0+PTX" CACHE STRING
    "CUDA architectures (TORCH_CUDA_ARCH_LIST form) when neither the user nor a local GPU names any")

function(fusedamp_choose_cuda_architectures out)
  set(archs "")
  if(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT CMAKE_CUDA_ARCHITECTURES STREQUAL "OFF"
     AND NOT CMAKE_CUDA_ARCHITECTURES STREQUAL "")
    set(archs "${CMAKE_CUDA_ARCHITECTURES}")
  else()
    set(list_ "")
    if(DEFINED TORCH_CUDA_ARCH_LIST AND NOT TORCH_CUDA_ARCH_LIST STREQUAL "")
      set(list_ "${TORCH_CUDA_ARCH_LIST}")
    elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
      set(list_ "$ENV{TORCH_CUDA_ARCH_LIST}")
    else()
      find_program(_nvsmi nvidia-smi)
      if(_nvsmi)
        execute_process(COMMAND ${_nvsmi} --query-gpu=compute_cap --format=csv,noheader
          OUTPUT_VARIABLE caps RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
        if(rc EQUAL 0)
          # One "9.0" per GPU; anything else (a driver message such as "No devices were
          # found") is no GPU.
          string(REGEX MATCHALL "[0-9]+\\.[0-9]+" list_ "${caps}")
          list(REMOVE_DUPLICATES list_)
        endif()
      endif()
      if(list_ STREQUAL "")
        set(list_ "${FUSEDAMP_CUDA_ARCH_LIST_WITHOUT_GPU}")
        message(STATUS "fusedamp: no GPU found and no architectures given: "
                       "FUSEDAMP_CUDA_ARCH_LIST_WITHOUT_GPU=${list_}")
      endif()
    endif()
    string(REPLACE " " ";" list_ "${list_}")
    foreach(a IN LISTS list_)
      if(a STREQUAL "")
        continue()
      endif()
      set(ptx OFF)
      if(a MATCHES "\\+PTX$")
        set(ptx ON)
        string(REGEX REPLACE "\\+PTX$" "" a "${a}")
      endif()
      string(REPLACE "." "" num "${a}")
      if(ptx)
        list(APPEND archs "${num}-real" "${num}-virtual")
      else()
        list(APPEND archs "${num}-real")
      endif()
    endforeach()
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()
