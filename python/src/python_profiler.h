// varuna._C's Profiler bindings (python_profiler.cpp): the C++ Profiler
// (varuna/worker/profiler.h) over a model given in Python.
#pragma once

#include <pybind11/pybind11.h>

namespace varuna::python {

// Adds ProfilerOptions, Profiler and read_profile to the module.
void bindProfiler(pybind11::module_& m);

}  // namespace varuna::python
