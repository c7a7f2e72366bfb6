"""dmoe.hf: run the sparse MoE blocks of a loaded Hugging Face transformers model on dmoe's engines.

``replace_moe_blocks(model)`` swaps every supported sparse MoE block for a ``DmoeSparseMoeBlock`` that holds the same
weights (copied once into dmoe's layout: gate [E, H], w1/w3 [E, I, H], w2 [E, H, I]) and routes the same way, so
the model's logits, ``generate()`` and training work unchanged. Supported (the semantics map exactly):

* Mixtral (``MixtralSparseMoeBlock``): softmax over the router logits, top-k, renormalised to sum to 1;
* Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): the same, renormalised when ``config.norm_topk_prob``;
* Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): as Qwen3-MoE, plus the shared expert and its sigmoid gate, which are kept
  as they are (torch modules) and added to dmoe's output.

Both layouts of transformers are read: 5.x (fused ``experts.gate_up_proj`` [E, 2I, H] — gate projection first —
and ``experts.down_proj`` [E, H, I], router ``gate.weight``; the block returns the hidden states and the router
logits are recorded from the router module) and 4.x (``experts`` a ModuleList of per-expert MLPs, ``gate`` an
nn.Linear; the block returns ``(hidden_states, router_logits)``). The replacement returns what the replaced block
returned. In 5.x it keeps a router submodule of the model's router class (``gate``, whose ``weight`` is the dmoe
layer's gate parameter) that is called only while transformers records router logits (``output_router_logits``),
so the load-balancing loss and its gradient work as in the stock model.

``restore_moe_blocks(model)`` puts stock blocks holding the current weights back (for ``save_pretrained``: a
replaced model's state_dict names the dmoe layers' parameters, ``mlp.moe.w1`` etc.).

Expert activation must be SiLU (``hidden_act`` 'silu'): dmoe's 'swiglu' is silu(w1 x) * (w3 x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .module import MoELayer

_SUPPORTED = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock")


def _recording_router_logits() -> bool:
    """Whether transformers (5.x) is recording router logits in the current forward."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except Exception:  # another transformers version: compute them always (cheap: [T, H] x [H, E])
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


def _make_router(router_class, weight, top_k):
    """A module of the model's router class (so transformers' output recorder finds it) that returns the logits."""

    class DmoeRouterLogits(router_class):
        def __init__(self):
            torch.nn.Module.__init__(self)  # not the HF router's __init__: no weights of its own
            self.weight = weight
            self.top_k = top_k
            self.num_experts, self.hidden_dim = weight.shape

        def forward(self, hidden_states):
            logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            return logits, None, None

    DmoeRouterLogits.__name__ = DmoeRouterLogits.__qualname__ = "Dmoe" + router_class.__name__
    return DmoeRouterLogits()


class DmoeSparseMoeBlock(torch.nn.Module):
    """One replaced HF sparse MoE block: ``moe`` (a dmoe.MoELayer) plus what the block kept in torch."""

    def __init__(self, moe: MoELayer, *, returns_logits: bool, router_class=None, jitter_noise: float = 0.0,
                 shared_expert=None, shared_expert_gate=None, stock_class=None):
        torch.nn.Module.__init__(self)  # not super(): in _block_class's subclasses that is the stock block's
        self.moe = moe
        self.stock_class = stock_class  # the replaced block's class (restore_moe_blocks)
        self.returns_logits = returns_logits  # 4.x: (hidden_states, router_logits)
        self.jitter_noise = float(jitter_noise)
        self.gate = _make_router(router_class, moe.gate, moe.top_k) if router_class is not None else None
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as the stock block applies it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, shape[-1])
        y = self.moe(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        y = y.reshape(shape)
        if self.returns_logits:
            return y, F.linear(x, self.moe.gate)
        if self.gate is not None and _recording_router_logits():
            self.gate(x)  # its output is what transformers' recorder hooks collect
        return y


_BLOCK_CLASSES: dict = {}


def _block_class(stock_class):
    """DmoeSparseMoeBlock that is also an instance of the stock block's class (dmoe's forward first): transformers
    4.5x records router logits from the blocks of that class (OutputRecorder(MixtralSparseMoeBlock, index=1))."""
    if stock_class not in _BLOCK_CLASSES:
        _BLOCK_CLASSES[stock_class] = type("Dmoe" + stock_class.__name__, (DmoeSparseMoeBlock, stock_class),
                                           {"__module__": __name__})
    return _BLOCK_CLASSES[stock_class]


def _block_kind(module):
    name = type(module).__name__
    return name if name in _SUPPORTED else None


def _expert_weights(block, kind):
    """(gate [E, H], w1 [E, I, H], w3 [E, I, H], w2 [E, H, I]) of a block, in either transformers layout."""
    experts = block.experts
    if isinstance(experts, torch.nn.ModuleList):  # 4.x: one MLP per expert
        if kind == "MixtralSparseMoeBlock":
            w1 = torch.stack([e.w1.weight for e in experts])
            w3 = torch.stack([e.w3.weight for e in experts])
            w2 = torch.stack([e.w2.weight for e in experts])
        else:
            w1 = torch.stack([e.gate_proj.weight for e in experts])
            w3 = torch.stack([e.up_proj.weight for e in experts])
            w2 = torch.stack([e.down_proj.weight for e in experts])
        return block.gate.weight, w1, w3, w2, True
    gate_up = experts.gate_up_proj  # 5.x: [E, 2I, H], the gate projection's rows first (chunk(2) of the product)
    inter = gate_up.shape[1] // 2
    return block.gate.weight, gate_up[:, :inter], gate_up[:, inter:], experts.down_proj, False


def _check_activation(block, config):
    act = getattr(config, "hidden_act", "silu") if config is not None else "silu"
    if act != "silu":
        raise ValueError(f"dmoe.hf: {type(block).__name__} uses hidden_act '{act}'; dmoe's experts are SwiGLU with "
                         "SiLU (hidden_act 'silu') only")


def replace_moe_blocks(model: torch.nn.Module, engine: str = "auto", world: int = 1, **layer_kwargs) -> int:
    """Replaces every supported sparse MoE block of ``model`` in place; returns how many were replaced.

    ``engine``/``world``/``layer_kwargs`` go to ``dmoe.MoELayer`` (e.g. ``capacity_factor``, ``max_tokens``). The
    layer is made on the block's device and dtype (engine 'auto': 'ep' on CUDA, 'cpu' on the CPU, which computes in
    float32). With world > 1 on CUDA each rank keeps its E/world experts (its rank from the launcher's environment).
    Raises ValueError naming the block when its semantics cannot be mapped, or when the CPU engine would get
    parameters that are not float32; then no block is replaced (every replacement is made before any is swapped in).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"dmoe.hf.replace_moe_blocks: model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    made = []
    targets = [(name, module) for name, module in model.named_modules() if _block_kind(module)]
    for name, block in targets:
        kind = _block_kind(block)
        _check_activation(block, text_config)
        gate, w1, w3, w2, per_expert = _expert_weights(block, kind)
        experts, hidden = gate.shape
        ffn = w1.shape[1]
        on_cpu = engine == "cpu" or (engine == "auto" and gate.device.type != "cuda")
        if on_cpu and gate.dtype != torch.float32:
            raise ValueError(f"dmoe.hf.replace_moe_blocks: {name} holds {gate.dtype} weights on {gate.device}, and "
                             "engine 'cpu' computes in float32: convert the model first (model.float()), or move it to "
                             "CUDA (engine 'ep' stores float32 or bfloat16)")
        top_k = getattr(block, "top_k", None) or getattr(block.gate, "top_k", None) or text_config.num_experts_per_tok
        if kind == "MixtralSparseMoeBlock":
            renormalize = True
        else:
            renormalize = bool(getattr(block.gate, "norm_topk_prob", getattr(block, "norm_topk_prob",
                                                                             text_config.norm_topk_prob)))
        layer = MoELayer(hidden, ffn, experts, int(top_k), "swiglu", world=world, engine=engine,
                         renormalize=renormalize, device=gate.device, dtype=gate.dtype, **layer_kwargs)
        first, held = layer.first_expert, layer.w1.shape[0]
        with torch.no_grad():
            layer.gate.copy_(gate)
            layer.w1.copy_(w1[first:first + held])
            layer.w3.copy_(w3[first:first + held])
            layer.w2.copy_(w2[first:first + held])
        new = _block_class(type(block))(
            layer, returns_logits=per_expert, router_class=None if per_expert else type(block.gate),
            jitter_noise=getattr(block, "jitter_noise", 0.0) if kind == "MixtralSparseMoeBlock" else 0.0,
            shared_expert=getattr(block, "shared_expert", None),
            shared_expert_gate=getattr(block, "shared_expert_gate", None), stock_class=type(block))
        new.train(block.training)
        made.append((name, new, per_expert))
    for name, new, per_expert in made:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        if not per_expert and new.gate is not None and _hooks_installed(model):
            _install_router_hook(new.gate)
    return len(made)


def _hooks_installed(model) -> bool:
    return any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules())


def _install_router_hook(router) -> None:
    """The model ran before the replacement, so transformers installed its recorder hooks then (on the old
    router): add the same hook on the new one."""
    from transformers.utils.output_capturing import install_output_capuring_hook

    install_output_capuring_hook(router, "router_logits", 0)


def restore_moe_blocks(model: torch.nn.Module) -> int:
    """The inverse of replace_moe_blocks: every DmoeSparseMoeBlock becomes a block of the class it replaced, made
    from the model's config and holding the dmoe block's current weights (e.g. after training, before
    ``save_pretrained``, whose tensor names are the stock blocks'); the shared expert modules move back as they
    are. Returns how many were restored. Needs every expert in this process (engine 'cpu', or world = 1).
    """
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, DmoeSparseMoeBlock)]
    for name, blk in targets:
        layer = blk.moe
        if layer.w1.shape[0] != layer.experts:
            raise ValueError(f"dmoe.hf.restore_moe_blocks: {name} holds {layer.w1.shape[0]} of {layer.experts} "
                             "experts (this rank's share, world > 1); gather every expert first")
        if blk.stock_class is None or text_config is None:
            raise ValueError(f"dmoe.hf.restore_moe_blocks: {name} does not know the block class it replaced or the "
                             "model has no config")
        with torch.device(layer.gate.device):
            stock = blk.stock_class(text_config)
        stock = stock.to(layer.gate.dtype)
        with torch.no_grad():
            if isinstance(stock.experts, torch.nn.ModuleList):  # 4.x
                stock.gate.weight.copy_(layer.gate)
                mixtral = hasattr(stock.experts[0], "w1")
                for e, mlp in enumerate(stock.experts):
                    (mlp.w1 if mixtral else mlp.gate_proj).weight.copy_(layer.w1[e])
                    (mlp.w3 if mixtral else mlp.up_proj).weight.copy_(layer.w3[e])
                    (mlp.w2 if mixtral else mlp.down_proj).weight.copy_(layer.w2[e])
            else:  # 5.x: gate_up_proj = [w1; w3] per expert
                stock.gate.weight.copy_(layer.gate)
                stock.experts.gate_up_proj.copy_(torch.cat([layer.w1, layer.w3], dim=1))
                stock.experts.down_proj.copy_(layer.w2)
        if blk.shared_expert is not None:
            stock.shared_expert = blk.shared_expert
        if blk.shared_expert_gate is not None:
            stock.shared_expert_gate = blk.shared_expert_gate
        stock.train(blk.training)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, stock)
        if _hooks_installed(model) and not isinstance(stock.experts, torch.nn.ModuleList):
            _install_router_hook(stock.gate)
    return len(targets)
