// Every decoder layer of a step whose tokens attend on the kernel, in one C++ call (see decode_stack.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

void register_decode_stack(pybind11::module& m);

}  // namespace kiln
