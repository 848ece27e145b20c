# install_consumer.cmake - ctest script: install the build into a scratch prefix, then build and run
# install_consumer/consumer.c against it twice: with pkg-config's flags and through find_package(kvattn).
# -DBUILD=<kvattn build dir> -DSRC=<tests/install_consumer> -DWORK=<scratch dir> -DCC=<C compiler> [-DPKGCONFIG=<exe>]
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(PREFIX "${WORK}/prefix")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD}" --prefix "${PREFIX}" --component Unspecified
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
file(GLOB_RECURSE pcs "${PREFIX}/*/kvattn.pc")
file(GLOB_RECURSE cfgs "${PREFIX}/*/kvattnConfig.cmake")
if(NOT pcs OR NOT cfgs)
  message(FATAL_ERROR "the install lacks kvattn.pc or kvattnConfig.cmake: ${pcs} ${cfgs}")
endif()
list(GET pcs 0 pc)
get_filename_component(pcdir "${pc}" DIRECTORY)
get_filename_component(libdir "${pcdir}" DIRECTORY)

# 1. pkg-config
if(PKGCONFIG)
  set(ENV{PKG_CONFIG_PATH} "${pcdir}")
  execute_process(COMMAND "${PKGCONFIG}" --cflags --libs kvattn OUTPUT_VARIABLE flags RESULT_VARIABLE rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config --cflags --libs kvattn failed (${rc})")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  execute_process(COMMAND "${CC}" -std=c11 -Wall -Werror "${SRC}/consumer.c" -o "${WORK}/consumer_pc" ${flags} -lm
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "compiling consumer.c with pkg-config's flags (${flags}) failed (${rc})")
  endif()
  set(ENV{LD_LIBRARY_PATH} "${libdir}")
  execute_process(COMMAND "${WORK}/consumer_pc" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (pkg-config build) failed (${rc})")
  endif()
else()
  message(STATUS "no pkg-config: that half skipped")
endif()

# 2. find_package(kvattn) from another CMake project (the imported target carries the include directory; the
#    executable finds the library through its build RPATH)
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SRC}" -B "${WORK}/cmake_build" "-DCMAKE_PREFIX_PATH=${PREFIX}"
                        "-DCMAKE_C_COMPILER=${CC}" RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer project (find_package(kvattn)) failed (${rc})")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK}/cmake_build" RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer project failed (${rc})")
endif()
execute_process(COMMAND "${WORK}/cmake_build/consumer" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer (find_package build) failed (${rc})")
endif()
