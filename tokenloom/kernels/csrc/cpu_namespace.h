// The namespace of one build of tokenloom's CPU operators. The same sources are compiled once
// per ISA level (tokenloom/kernels/cpu_native.py passes -DTOKENLOOM_CPU_NAMESPACE=tokenloom_cpu_avx2,
// ..._avx512, ..._generic), and several levels load in one process (the tests run every level the
// host can): each build names its C++ namespace and its torch op namespace after its level, so
// neither the operators nor the symbols of two builds (templates' static locals are merged across
// libraries by the dynamic linker) meet.
#pragma once

#ifndef TOKENLOOM_CPU_NAMESPACE
#define TOKENLOOM_CPU_NAMESPACE tokenloom_cpu
#endif

// torch's registration macros paste their namespace argument unexpanded: expand it first
#define TOKENLOOM_EXPAND_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TOKENLOOM_EXPAND_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TOKENLOOM_EXPAND_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define TOKENLOOM_LIBRARY(m) TOKENLOOM_EXPAND_LIBRARY(TOKENLOOM_CPU_NAMESPACE, m)
#define TOKENLOOM_LIBRARY_FRAGMENT(m) TOKENLOOM_EXPAND_LIBRARY_FRAGMENT(TOKENLOOM_CPU_NAMESPACE, m)
#define TOKENLOOM_LIBRARY_IMPL_CPU(m) TOKENLOOM_EXPAND_LIBRARY_IMPL(TOKENLOOM_CPU_NAMESPACE, m)
