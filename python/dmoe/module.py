"""dmoe.MoELayer: a torch.nn.Module over dmoe's engines (imported lazily by ``dmoe``; needs torch).

The gate and the experts are ``torch.nn.Parameter`` s (any optimizer, ``state_dict``, ``torch.save`` work); the
forward and backward run in dmoe's engine through one ``torch.autograd.Function``, on torch's current CUDA
stream, reading and writing torch's memory through DLPack without copies.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple, Optional

import torch

from ._checks import check_bool, check_choice, check_float, check_int
from ._dmoe import Session, cuda_built

_ENGINES = ("auto", "cpu", "ep", "flash")
_ACTIVATIONS = ("relu", "gelu", "swiglu", "silu")  # silu: swiglu's alias, as in dmoe.layer_forward
_DROP_POLICIES = ("latest-tokens", "lowest-weight")
_COMMS = ("auto", "nccl", "nvshmem")
# The router losses of the forward that just ran in this thread (threads may share a layer).
_LAST = threading.local()


class MoEOutput(NamedTuple):
    """What ``MoELayer.forward(x, return_routing=True)`` returns.

    ``y`` has x's shape; ``expert_ids`` [N, k] int32 and ``expert_weights`` [N, k] float32 (N = tokens, the rows of
    x); ``router_logits`` [N, E] float32 (None for engine 'flash'). ``load_balance`` and ``z_loss`` are floats over
    all ranks' tokens, None after a forward that kept nothing for a backward (no gradients needed).
    They are reported, not differentiable: their gradients, weighted by the layer's ``aux_loss_coef`` and
    ``z_loss_coef``, are already part of the layer's backward. The routing outputs carry no gradient.
    """

    y: torch.Tensor
    expert_ids: torch.Tensor
    expert_weights: torch.Tensor
    router_logits: Optional[torch.Tensor]
    load_balance: Optional[float]
    z_loss: Optional[float]


def map_launcher_env() -> None:
    """Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) describe the ranks the way
    ``dmoe launch`` does (DMOE_RANK, DMOE_WORLD, DMOE_LOCAL_RANK, DMOE_LOCAL_WORLD, DMOE_RENDEZVOUS), so that dmoe's
    communicators bootstrap through a rendezvous directory. Nothing changes when DMOE_RANK is set already (dmoe
    launch), or under mpirun/srun (dmoe reads their variables itself). The directory must be shared by all ranks:
    on one node a directory under /tmp named after the torchrun agent is; across nodes set DMOE_RENDEZVOUS to a
    directory on a shared file system (an error says so otherwise).
    """
    env = os.environ
    if "DMOE_RANK" in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return
    # Slurm's variables describe ranks only in an srun step (SLURM_STEP_ID); a batch script's own process has
    # SLURM_PROCID too (torchrun started from an sbatch script is torchrun's world), as dmoe's detection reads it.
    if "OMPI_COMM_WORLD_RANK" in env or ("SLURM_PROCID" in env and "SLURM_STEP_ID" in env) or "PMI_RANK" in env:
        return
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if "DMOE_RENDEZVOUS" not in env:
        if local_world != world:
            raise RuntimeError(
                f"dmoe: torchrun runs {world} ranks on several nodes ({local_world} on this one); dmoe's communicators "
                "meet through a rendezvous directory that every rank must see: set DMOE_RENDEZVOUS to a directory "
                "on a shared file system (the same path on every node, empty or new for each run)")
        tag = "-".join(str(v) for v in (env.get("MASTER_ADDR", "local"), env.get("MASTER_PORT", "0"),
                                          env.get("TORCHELASTIC_RUN_ID", "run"), os.getppid()))
        env["DMOE_RENDEZVOUS"] = os.path.join("/tmp", "dmoe-torchrun-" + tag.replace("/", "_"))
    os.makedirs(env["DMOE_RENDEZVOUS"], exist_ok=True)
    env["DMOE_RANK"] = env["RANK"]
    env["DMOE_WORLD"] = env["WORLD_SIZE"]
    env["DMOE_LOCAL_RANK"] = env.get("LOCAL_RANK", env["RANK"])
    env["DMOE_LOCAL_WORLD"] = str(local_world)


def init_from_process_group(group=None) -> None:
    """Let dmoe's communicators start through an existing ``torch.distributed`` process group: its ranks become
    dmoe's ranks (rank = the group's rank, world = its size), and the NCCL / NVSHMEM unique ids travel by
    ``broadcast_object_list`` over the group, so no shared rendezvous directory, torchrun environment or MPI is
    needed. Call it on every rank after ``torch.distributed.init_process_group`` (and ``torch.cuda.set_device``
    for an NCCL group), before the first ``MoELayer(world=...)`` forward. The node-local placement comes from
    LOCAL_RANK / LOCAL_WORLD_SIZE when set (torchrun, most launchers), else all ranks are taken to share one node.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("dmoe.init_from_process_group: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("dmoe.init_from_process_group: this process is not a member of the group")
    env = os.environ
    if "DMOE_RANK" in env and (env["DMOE_RANK"] != str(rank) or env.get("DMOE_WORLD") != str(world)):
        raise ValueError(f"dmoe.init_from_process_group: DMOE_RANK={env['DMOE_RANK']} / DMOE_WORLD="
                         f"{env.get('DMOE_WORLD')} (dmoe launch) disagree with the group's rank {rank} of {world}")
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    local_rank = int(env.get("LOCAL_RANK", rank % local_world))
    env["DMOE_RANK"], env["DMOE_WORLD"] = str(rank), str(world)
    env["DMOE_LOCAL_RANK"], env["DMOE_LOCAL_WORLD"] = str(local_rank), str(local_world)
    src = 0 if group is None else dist.get_global_rank(group, 0)

    def exchange(name: str, payload: bytes) -> bytes:
        box = [payload if rank == 0 else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    from . import _dmoe

    _dmoe._set_bootstrap_exchange(exchange)


def _dlpack(t: torch.Tensor):
    """What the extension receives: the tensor itself without autograd (DLPack refuses tensors that require grad)."""
    return t.detach()


class _Ticket:
    """A train forward's engine state, kept until its backward; freed with the autograd graph otherwise."""

    __slots__ = ("session", "id")

    def __init__(self, session, ticket):
        self.session = session
        self.id = ticket

    def take(self):
        ticket, self.id = self.id, -1
        return ticket

    def __del__(self):
        # getattr: torch.compile's tracing can make objects of the class without running __init__
        if getattr(self, "id", -1) >= 0:
            self.session.release(self.id)


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, train, want_routing, x2d, gate, w1, w3, w2):
        s = layer._session_for(x2d)
        rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        routing = (None, None, None)
        if want_routing:
            ids = torch.empty((rows, layer.top_k), dtype=torch.int32, device=x2d.device)
            weights = torch.empty((rows, layer.top_k), dtype=torch.float32, device=x2d.device)
            logits = None if layer.engine == "flash" else torch.empty((rows, layer.experts), dtype=torch.float32,
                                                                       device=x2d.device)
            routing = (ids, weights, logits)
        layer._before_call(x2d)
        ticket = s.forward(_dlpack(x2d), y, _dlpack(gate), _dlpack(w1), None if w3 is None else _dlpack(w3),
                           _dlpack(w2), train=train, expert_ids=routing[0], expert_weights=routing[1],
                           router_logits=routing[2])
        losses = (None, None)
        if ticket >= 0:
            # Read only when returned: reading them waits for the GPU (the engine defers the read otherwise, so
            # that the forward does not hold back the work queued after it).
            if want_routing:
                losses = s.losses(ticket)
            ctx.ticket = _Ticket(s, ticket)
            ctx.save_for_backward(x2d, gate, w1, w3, w2)  # the engine reads them again in the backward
        ctx.layer = layer
        _LAST.losses = losses
        outs = [r for r in routing if r is not None]
        ctx.mark_non_differentiable(*outs)
        return (y, *routing)

    @staticmethod
    def backward(ctx, dy, *_routing_grads):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would carry no graph, so their own gradient
            # (a gradient penalty, a Hessian-vector product) would silently be missing this layer's part
            raise RuntimeError("dmoe: MoELayer's backward is not differentiable (the engine computes the gradients "
                               "outside autograd): a double backward, torch.autograd.grad(..., create_graph=True), "
                               "is not supported")
        ticket = getattr(ctx, "ticket", None)
        if ticket is None or ticket.id < 0:
            raise RuntimeError("dmoe: this MoELayer forward kept no state for a backward pass (it ran without "
                               "gradients, or its backward already ran: retain_graph / a second backward through "
                               "the same forward is not supported)")
        layer = ctx.layer
        x2d, gate, w1, w3, w2 = ctx.saved_tensors
        s = ticket.session  # the session of that forward (the layer may have made a new one since, e.g. .to())
        dy = dy.contiguous()
        dx = torch.empty_like(x2d)
        gdt = torch.float64 if s.grad_dtype == "f64" else torch.float32
        # bf16 experts on CUDA: the engine stores their gradients in bf16 directly (each f32 product rounded once,
        # what the cast below would give) instead of f32 that is then read again and cast: 3x fewer bytes.
        edt = torch.bfloat16 if (w1.dtype == torch.bfloat16 and w1.is_cuda and s.grad_dtype == "f32") else gdt
        dgate = torch.empty(gate.shape, dtype=gdt, device=gate.device)
        dw1 = torch.empty(w1.shape, dtype=edt, device=w1.device)
        dw3 = None if w3 is None else torch.empty(w3.shape, dtype=edt, device=w3.device)
        dw2 = torch.empty(w2.shape, dtype=edt, device=w2.device)
        layer._before_call(x2d)
        s.backward(ticket.take(), dy, dx, dgate, dw1, dw3, dw2)
        need = ctx.needs_input_grad

        def cast(g, p, i):
            return g.to(p.dtype) if need[i] else None

        return (None, None, None, dx if need[3] else None, cast(dgate, gate, 4), cast(dw1, w1, 5),
                None if w3 is None else cast(dw3, w3, 6), cast(dw2, w2, 7))


class MoELayer(torch.nn.Module):
    """A Mixture-of-Experts layer run by dmoe's engines.

    Args:
        hidden, ffn, experts, top_k: H, I, E, k.
        activation: 'swiglu' (Mixtral: w2 @ (silu(w1 @ x) * (w3 @ x))), 'gelu' or 'relu' (w2 @ act(w1 @ x)).
        world: ranks the experts are spread over. Engine 'cpu': simulated ranks (threads) in this process, which
            holds all experts and all ranks' tokens (the token count must be a multiple of world). 'ep'/'flash':
            one process per rank (torchrun, dmoe launch, mpirun, srun), each holding its E/world experts
            (experts rank·E/world ..) and its own tokens; every rank must call forward/backward alike.
        engine: 'cpu' (the reference engine), 'ep' (expert parallelism on CUDA; its inference forward at world 1
            with bf16 parameters, dropless, can be captured in a CUDA graph), 'flash' (the forward as one
            persistent kernel per rank, bf16; it trains too: its backward is a short sequence of launches that
            synchronises the host, so a training step cannot be captured in a CUDA graph), 'auto': 'ep' for inputs on a CUDA
            device, else 'cpu' (decided at each call with world = 1, from ``device`` at construction otherwise).
        renormalize: renormalise the k gate weights to sum to 1 (Mixtral; Qwen's norm_topk_prob).
        capacity_factor: 0 = dropless; else each (rank, expert) keeps at most ceil(cf·T·k/E) rows.
        drop_policy: 'latest-tokens' or 'lowest-weight' (capacity mode).
        aux_loss_coef, z_loss_coef: weights of the load-balancing and z losses in the backward pass.
        device, dtype: of the parameters (the CPU engine computes in float32 only; CUDA: float32 or bfloat16).
        max_tokens: CUDA, world > 1: most tokens one forward passes on a rank (sizes the communicator's buffers).
        comm: CUDA, world > 1: 'auto', 'nccl' or 'nvshmem'.

    Parameters: ``gate`` [E, H]; ``w1`` [E/world', I, H] (gate projection), ``w3`` (up projection, swiglu only) the
    same, ``w2`` [E/world', H, I], where world' = world on CUDA and 1 on the CPU engine (it holds all experts).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, activation: str = "swiglu", world: int = 1,
                 engine: str = "auto", *, renormalize: bool = True, capacity_factor: float = 0.0,
                 drop_policy: str = "latest-tokens", aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 device=None, dtype=None, max_tokens: int = 8192, comm: str = "auto"):
        super().__init__()
        where = "dmoe.MoELayer"
        check_choice(where, "engine", engine, _ENGINES)
        check_choice(where, "activation", activation, _ACTIVATIONS)
        activation = "swiglu" if activation == "silu" else activation
        # Every argument is checked here, not at the first forward (where a wrong type was nanobind's "incompatible
        # function arguments" and a bad value the engine's error, after the layer had been made and placed).
        hidden, ffn = check_int(where, "hidden", hidden, hi=2**62), check_int(where, "ffn", ffn, hi=2**62)
        experts, top_k = check_int(where, "experts", experts), check_int(where, "top_k", top_k)
        world = check_int(where, "world", world)
        max_tokens = check_int(where, "max_tokens", max_tokens, hi=2**62)
        capacity_factor = check_float(where, "capacity_factor", capacity_factor, "0 (dropless) or a finite number > 0")
        aux_loss_coef = check_float(where, "aux_loss_coef", aux_loss_coef)
        z_loss_coef = check_float(where, "z_loss_coef", z_loss_coef)
        renormalize = check_bool(where, "renormalize", renormalize)
        check_choice(where, "drop_policy", drop_policy, _DROP_POLICIES)
        check_choice(where, "comm", comm, _COMMS)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"{where}: dtype = {dtype!r} is a {type(dtype).__name__}; must be a torch.dtype "
                            "(torch.float32 or, on CUDA, torch.bfloat16) or None")
        if experts % world:
            raise ValueError(f"dmoe.MoELayer: experts = {experts} cannot be split over world = {world} ranks; "
                             "experts must be a multiple of world")
        if top_k > experts:
            raise ValueError(f"dmoe.MoELayer: top_k = {top_k} is larger than experts = {experts}")
        # The rest of the config's rules (the engine's own check, on a CPU session that allocates nothing).
        Session(hidden, ffn, experts, top_k, activation, world=world, engine="cpu", renormalize=renormalize,
                capacity_factor=capacity_factor, drop_policy=drop_policy, aux_loss_coef=aux_loss_coef,
                z_loss_coef=z_loss_coef, max_tokens=max_tokens)
        device = torch.device(device) if device is not None else torch.device("cpu")
        # 'auto' with one rank follows the input's device at every call (layer.cuda() then runs 'ep'); with several
        # ranks the parameters' shapes depend on the engine, so it is decided here.
        self._auto = engine == "auto" and world == 1
        if engine == "auto":
            engine = "ep" if device.type == "cuda" else "cpu"
        if engine != "cpu" and not cuda_built():
            raise ValueError(f"dmoe.MoELayer: engine '{engine}' needs dmoe's CUDA engines, and this build has none "
                             "(built without a CUDA toolkit); use engine='cpu'")
        self.hidden, self.ffn, self.experts, self.top_k = hidden, ffn, experts, top_k
        self.activation, self.world, self.engine = activation, world, engine
        self.renormalize, self.capacity_factor, self.drop_policy = renormalize, float(capacity_factor), drop_policy
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.max_tokens, self.comm = max_tokens, comm
        held = experts if engine == "cpu" else experts // world
        kw = {"device": device, "dtype": dtype if dtype is not None else torch.float32}
        self.gate = torch.nn.Parameter(torch.empty(experts, hidden, **kw))
        self.w1 = torch.nn.Parameter(torch.empty(held, ffn, hidden, **kw))
        self.w3 = torch.nn.Parameter(torch.empty(held, ffn, hidden, **kw)) if activation == "swiglu" else None
        self.w2 = torch.nn.Parameter(torch.empty(held, hidden, ffn, **kw))
        self._session = None
        self._session_key = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ±1/sqrt(fan_in) (torch.nn.Linear's bound): gate and w1/w3 fan_in H, w2 fan_in I."""
        with torch.no_grad():
            for p, fan_in in ((self.gate, self.hidden), (self.w1, self.hidden), (self.w3, self.hidden),
                              (self.w2, self.ffn)):
                if p is not None:
                    bound = 1.0 / math.sqrt(fan_in)
                    p.uniform_(-bound, bound)

    @property
    def first_expert(self) -> int:
        """The first expert this process holds (experts first_expert .. first_expert + w1.shape[0] - 1)."""
        if self.engine == "cpu":
            return 0
        return self._rank() * (self.experts // self.world)

    def _rank(self) -> int:
        if self._session is not None:
            return self._session.rank
        map_launcher_env()
        for var in ("DMOE_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"):
            if var in os.environ and (var != "SLURM_PROCID" or "SLURM_STEP_ID" in os.environ):
                return int(os.environ[var])
        return 0

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}, top_k={self.top_k}, "
                f"activation={self.activation}, world={self.world}, engine={self.engine}")

    # ---- the engine session ----------------------------------------------------------------------------------
    def _session_for(self, x):
        if self._auto:
            self.engine = "ep" if x.device.type == "cuda" else "cpu"
        dtype = self.w1.dtype
        key = (x.device, dtype, self.engine)
        if self._session is not None and self._session_key == key:
            return self._session
        if self.engine == "cpu":
            if x.device.type != "cpu":
                raise ValueError(f"dmoe.MoELayer: engine 'cpu' got x on {x.device}; move the layer and its input "
                                 "to the CPU, or build the layer with engine='ep' for CUDA")
            if dtype != torch.float32:
                raise TypeError(f"dmoe.MoELayer: engine 'cpu' computes in float32; the parameters are {dtype} "
                                "(layer.float())")
            storage, device = "f32", -1
        else:
            if x.device.type != "cuda":
                raise ValueError(f"dmoe.MoELayer: engine '{self.engine}' runs on CUDA; x is on {x.device} "
                                 "(layer.cuda() and x.cuda(), or engine='cpu')")
            if dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"dmoe.MoELayer: engine '{self.engine}' stores float32 or bfloat16; the parameters "
                                f"are {dtype}")
            storage, device = ("bf16" if dtype == torch.bfloat16 else "f32"), x.device.index
            if self.world > 1:
                map_launcher_env()
                os.environ.setdefault("DMOE_DEVICE", str(device))
        self._session = None  # free the old engines before making new ones
        self._session = Session(self.hidden, self.ffn, self.experts, self.top_k, self.activation, world=self.world,
                                engine=self.engine, dtype=storage, renormalize=self.renormalize,
                                capacity_factor=self.capacity_factor, drop_policy=self.drop_policy,
                                aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef, device=device,
                                comm=self.comm, max_tokens=self.max_tokens)
        self._session_key = key
        return self._session

    def _before_call(self, x):
        if x.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(x.device)
        # Engine 'ep' in a CUDA-graph capture: its inference forward at world 1 (bf16, dropless) waits for nothing
        # and is captured; anything else is refused by the engine before it queues work (a clear error).
        self._session.set_stream(stream.cuda_stream)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_session"] = None  # engine state is not picklable: made again at the next forward
        state["_session_key"] = None
        return state

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, return_routing: bool = False):
        """y = layer(x) for x [..., H] (the parameters' dtype and device); with return_routing a MoEOutput."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"dmoe.MoELayer: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.hidden:
            raise ValueError(f"dmoe.MoELayer: x has shape {list(x.shape)}; its last dimension must be hidden = "
                             f"{self.hidden}")
        if x.dtype != self.w1.dtype:
            raise TypeError(f"dmoe.MoELayer: x is {x.dtype} but the parameters are {self.w1.dtype}; they must match")
        for name in ("gate", "w1", "w3", "w2"):
            p = getattr(self, name)
            if p is not None and p.device != x.device:
                raise ValueError(f"dmoe.MoELayer: {name} is on {p.device} but x is on {x.device}; the parameters and "
                                 "the input must be on one device (layer.to(x.device))")
        x2d = x.reshape(-1, self.hidden).contiguous()
        params = [self.gate, self.w1, self.w3, self.w2]
        train = torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params))
        if x2d.shape[0] == 0:
            y = x2d.new_zeros(x2d.shape) + 0 * x2d.sum()  # keeps the autograd graph for an empty batch
            ids = torch.empty((0, self.top_k), dtype=torch.int32, device=x.device)
            out = (y, ids, ids.float(), None)
            losses = (None, None)
        else:
            _LAST.losses = (None, None)
            out = _MoEFunction.apply(self, train, return_routing, x2d, *params)
            losses = _LAST.losses
        y = out[0].reshape(x.shape)
        if not return_routing:
            return y
        return MoEOutput(y, out[1], out[2], out[3], *losses)

