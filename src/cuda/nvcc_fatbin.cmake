# nvcc_fatbin.cmake - compile the prebuilt kernels into a fatbin for one target and keep the ptxas report.
# cmake -DNVCC=... -DARCH=90a -DIN=aot.cu -DOUT=x.fatbin -DINC=src/kernels -DLOG=x.txt -P nvcc_fatbin.cmake
execute_process(
  COMMAND "${NVCC}" -fatbin -O3 -std=c++17 "-gencode=arch=compute_${ARCH},code=sm_${ARCH}" "-I${INC}"
          -Xptxas=-v,-warn-spills -o "${OUT}" "${IN}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(WRITE "${LOG}" "${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed for sm_${ARCH}:\n${out}${err}")
endif()
# summary: kernels, max registers, spills / stack frames
string(REGEX MATCHALL "Used [0-9]+ registers" regs "${err}")
set(maxreg 0)
list(LENGTH regs nk)
foreach(r ${regs})
  string(REGEX REPLACE "Used ([0-9]+) registers" "\\1" n "${r}")
  if(n GREATER maxreg)
    set(maxreg ${n})
  endif()
endforeach()
if(err MATCHES "[1-9][0-9]* bytes spill" OR err MATCHES "[1-9][0-9]* bytes stack frame")
  message(WARNING "kvattn prebuilt kernels sm_${ARCH}: spills or stack frames, see ${LOG}")
  set(sp "SPILLS (see log)")
else()
  set(sp "no spills, no stack frames")
endif()
message(STATUS "kvattn prebuilt kernels sm_${ARCH}: ${nk} kernels, max ${maxreg} registers, ${sp} (report: ${LOG})")
