// Everything the kernels share, by job (each header says what it holds):
//   aot.h      the MindSpore AOT entry point (MSLLM_AOT), per-kernel timing, argument checks
//   switches.h the environment variables that select a kernel path, read once per call
//   pool.h     the thread pool and parallel_rows
//   scratch.h  per-thread scratch buffers
//   stream.h   how the weight-streaming products read memory (pages, prefetch, row shares)
//   gemm.h     oneDNN's GEMM over the pool, bfloat16 weight slabs
//   vec.h      denormal mode, bfloat16 widening, exp, vectorised row helpers
#pragma once

#include "aot.h"
#include "gemm.h"
#include "pool.h"
#include "scratch.h"
#include "stream.h"
#include "switches.h"
#include "vec.h"
