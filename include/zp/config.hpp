// zp/config.hpp: the few macros every zp header relies on.
#pragma once

// Per-element math is written once and compiled for host and device: under nvcc these
// functions become __host__ __device__, under a plain C++ compiler they are ordinary inline.
#if defined(__CUDACC__)
#define ZP_HOST_DEVICE __host__ __device__
#define ZP_COMPILING_CUDA 1
#else
#define ZP_HOST_DEVICE
#define ZP_COMPILING_CUDA 0
#endif

// 1 when the CUDA runtime headers are reachable (the nccl backend and device allocations need
// them). Never changes the layout of a type, so translation units may disagree safely.
#if defined(__has_include)
#if __has_include(<cuda_runtime_api.h>)
#define ZP_HAS_CUDA_HEADERS 1
#else
#define ZP_HAS_CUDA_HEADERS 0
#endif
#else
#define ZP_HAS_CUDA_HEADERS 0
#endif

// 1 where this translation unit is built with AddressSanitizer (ZP_ASAN) or ThreadSanitizer
// (ZP_TSAN): GCC defines __SANITIZE_*__, Clang 16 answers only __has_feature.
#if defined(__SANITIZE_ADDRESS__)
#define ZP_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ZP_ASAN 1
#endif
#endif
#ifndef ZP_ASAN
#define ZP_ASAN 0
#endif
#if defined(__SANITIZE_THREAD__)
#define ZP_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ZP_TSAN 1
#endif
#endif
#ifndef ZP_TSAN
#define ZP_TSAN 0
#endif

#define ZP_VERSION_MAJOR 0
#define ZP_VERSION_MINOR 1
#define ZP_VERSION_PATCH 0
