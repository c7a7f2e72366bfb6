// dmoe/config.hpp — public: MoeConfig (the shape and semantics of one MoE layer), its validation, and its
// JSON form (dmoe JSON or a Hugging Face Mixtral config.json).
#pragma once

#include "core/config.hpp"
#include "core/dtype.hpp"
#include "model/config_io.hpp"
