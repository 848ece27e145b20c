# prefill.cmake - the tensor-core attention family (src/kernels/kva_prefill.cuh), included by src/cuda/cuda.cmake
# after KVA_CUDA_DIR / KVA_KERNEL_DIR are set and before the kernel sources are embedded and kva_aot.cu is generated.
#
# Provides:
#   KVA_PREFILL_KERNEL_FILES  kernel files to add to KVA_KERNEL_FILES (embedded for NVRTC, fatbin dependencies)
#   KVA_PREFILL_AOT_CU        text to append to kva_aot.cu: the prebuilt instances (same set as
#                             kva__cuda_prefill_aot_keys in cuda_prefill.c)
#   KVA_PREFILL_AOT_LIST      their symbol names
#   cuda_prefill.c in kvattn_obj; tests: kva_cuda_prefill_jit_test (CTest cuda_prefill_nvrtc, no GPU needed);
#   apps: kva_bench_prefill (GPU: WORKLOADS.md P1-P5, V1, and --check).

set(KVA_PREFILL_KERNEL_FILES kva_prefill_geom.h kva_wgmma.cuh kva_prefill.cuh)

# Prebuilt set: (d; q; kv; o) with dtype codes f16 = 1, bf16 = 2, e4m3 = 3; every tile (16, 64, 128; 128 not at
# head dim 256); no RoPE (RoPE instances are compiled by NVRTC on first use).
set(KVA_PREFILL_AOT_CU "")
set(KVA_PREFILL_AOT_LIST)
foreach(cfg "128;2;2;2" "128;1;1;1" "128;2;3;2" "64;2;2;2" "256;2;2;2")
  list(GET cfg 0 d)
  list(GET cfg 1 qt)
  list(GET cfg 2 kt)
  list(GET cfg 3 ot)
  set(pfdn_1 f16)
  set(pfdn_2 bf16)
  set(pfdn_3 e4m3)
  foreach(tq 16 64 128)
    if(d EQUAL 256 AND tq EQUAL 128)
      continue()
    endif()
    set(name "kva_pf_d${d}_q${pfdn_${qt}}_kv${pfdn_${kt}}_o${pfdn_${ot}}_t${tq}_rope0")
    list(APPEND KVA_PREFILL_AOT_LIST ${name})
    string(APPEND KVA_PREFILL_AOT_CU "#define KVA_KERNEL_NAME ${name}\n#define KVA_DQK ${d}\n#define KVA_DVO ${d}\n"
           "#define KVA_QT ${qt}\n#define KVA_KT ${kt}\n#define KVA_OT ${ot}\n#define KVA_TQ ${tq}\n"
           "#define KVA_ROPE 0\n#include \"kva_prefill.cuh\"\n"
           "#undef KVA_KERNEL_NAME\n#undef KVA_DQK\n#undef KVA_DVO\n#undef KVA_QT\n#undef KVA_KT\n#undef KVA_OT\n"
           "#undef KVA_TQ\n#undef KVA_ROPE\n\n")
  endforeach()
endforeach()

# The Hopper mainloop (KVA_MAINLOOP 1, "kva_pfw_*", tile 128; sm_90a code, an empty body in the sm_80 fatbin
# where the host never selects it): head dim 128 bf16 and f16, head dim 64 bf16, and head dim 128 bf16 with ALiBi
# folded (KVA_ALIBI_FOLD 1, "_afold"). Same set as kva__cuda_prefill_aot_keys.
foreach(cfg "128;2;0" "128;1;0" "64;2;0" "128;2;1")
  list(GET cfg 0 d)
  list(GET cfg 1 t)
  list(GET cfg 2 af)
  set(afs "")
  if(af EQUAL 1)
    set(afs "_afold")
  endif()
  set(name "kva_pfw_d${d}_q${pfdn_${t}}_kv${pfdn_${t}}_o${pfdn_${t}}_t128_rope0${afs}")
  list(APPEND KVA_PREFILL_AOT_LIST ${name})
  string(APPEND KVA_PREFILL_AOT_CU "#define KVA_KERNEL_NAME ${name}\n#define KVA_DQK ${d}\n#define KVA_DVO ${d}\n"
         "#define KVA_QT ${t}\n#define KVA_KT ${t}\n#define KVA_OT ${t}\n#define KVA_TQ 128\n#define KVA_ROPE 0\n"
         "#define KVA_MAINLOOP 1\n#define KVA_ALIBI_FOLD ${af}\n#include \"kva_prefill.cuh\"\n"
         "#undef KVA_KERNEL_NAME\n#undef KVA_DQK\n#undef KVA_DVO\n#undef KVA_QT\n#undef KVA_KT\n#undef KVA_OT\n"
         "#undef KVA_TQ\n#undef KVA_ROPE\n#undef KVA_MAINLOOP\n#undef KVA_ALIBI_FOLD\n\n")
endforeach()

target_sources(kvattn_obj PRIVATE ${KVA_CUDA_DIR}/cuda_prefill.c)

if(KVA_BUILD_TESTS)
  add_executable(kva_cuda_prefill_jit_test ${KVA_CUDA_DIR}/prefill_jit_test.c)
  target_include_directories(kva_cuda_prefill_jit_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/core ${KVA_CUDA_DIR}
                                                               ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_definitions(kva_cuda_prefill_jit_test PRIVATE KVA_KERNEL_DIR="${KVA_KERNEL_DIR}")
  target_link_libraries(kva_cuda_prefill_jit_test PRIVATE kvattn_static)
  target_compile_options(kva_cuda_prefill_jit_test PRIVATE ${KVA_WARNINGS})
  # covering set for sm_80 and sm_90a, spill-free; KVATTN_JIT_TEST_FULL=1 compiles all 384 keys
  add_test(NAME cuda_prefill_nvrtc COMMAND kva_cuda_prefill_jit_test)
  set_tests_properties(cuda_prefill_nvrtc PROPERTIES TIMEOUT 3600 LABELS "cuda;nogpu")
endif()
if(KVA_BUILD_APPS)
  add_executable(kva_bench_prefill ${CMAKE_CURRENT_SOURCE_DIR}/bench/bench_prefill.c)
  target_include_directories(kva_bench_prefill PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(kva_bench_prefill PRIVATE kvattn CUDA::cudart_static m)
  target_compile_options(kva_bench_prefill PRIVATE ${KVA_WARNINGS})
endif()
