// dmoe/error.hpp — public: dmoe::Error, what every dmoe call throws (bad input without a source location,
// internal errors with file:line; core/error.hpp says which is which).
#pragma once

#include "core/error.hpp"
