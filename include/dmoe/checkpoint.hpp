// dmoe/checkpoint.hpp — public: safetensors files (read, validated; written atomically) and MoE / Mixtral
// weights under the tensor names real checkpoints use.
#pragma once

#include "model/checkpoint.hpp"
#include "model/moe_weights.hpp"
#include "model/safetensors.hpp"
