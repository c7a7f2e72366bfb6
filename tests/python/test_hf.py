"""dmoe.hf.replace_moe_blocks on tiny random transformers models (CPU, float32): logits, the router's auxiliary
loss, a few training steps and generate() match the stock model. Skips without torch or transformers."""

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the Hugging Face tests need it")
tr = pytest.importorskip("transformers", reason="transformers is not installed: the Hugging Face tests need it")

import dmoe  # noqa: E402
import dmoe.hf  # noqa: E402

torch.set_num_threads(2)


def tiny(kind):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = tr.MixtralConfig(intermediate_size=48, num_local_experts=4, router_aux_loss_coef=0.02, **common)
        cls = tr.MixtralForCausalLM
    elif kind == "qwen2_moe":
        cfg = tr.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                num_experts=4, norm_topk_prob=False, router_aux_loss_coef=0.02, **common)
        cls = tr.Qwen2MoeForCausalLM
    else:
        cfg = tr.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=4, norm_topk_prob=True,
                                head_dim=8, router_aux_loss_coef=0.02, **common)
        cls = tr.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # larger random router weights than the init's, so routing differs token to token
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] == 4:
                p.normal_(std=0.5)
    return model


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def tokens(n=2, s=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (n, s), generator=g)


# float32 throughout; the stock blocks sum each token's expert products in another order (and the Qwen routers
# round nothing in f32): logits agree to ~2e-7 of their scale (measured); 1e-5 leaves room and is still 20x below
# what scaling one layer's w2 by 1.01 changes (2e-4).
TOL = 1e-5


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_aux_loss_match(kind):
    stock = tiny(kind)
    mine = copy.deepcopy(stock)
    n = dmoe.hf.replace_moe_blocks(mine)
    assert n == 2
    assert not any(type(m).__name__.endswith("SparseMoeBlock") and not isinstance(m, dmoe.hf.DmoeSparseMoeBlock)
                   for m in mine.modules())
    ids = tokens()
    with torch.no_grad():
        a = stock(ids, output_router_logits=True)
        b = mine(ids, output_router_logits=True)
    assert rel(b.logits, a.logits) < TOL
    assert a.aux_loss is not None and b.aux_loss is not None
    assert abs(float(b.aux_loss) - float(a.aux_loss)) < 1e-5 * abs(float(a.aux_loss))
    assert len(b.router_logits) == len(a.router_logits) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_match(kind):
    stock = tiny(kind).train()
    mine = copy.deepcopy(stock)
    dmoe.hf.replace_moe_blocks(mine)
    ids = tokens(seed=2)
    losses = []
    for model in (stock, mine):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        run = []
        for _ in range(4):
            opt.zero_grad()
            out = model(ids, labels=ids, output_router_logits=True)  # loss includes the router's aux loss
            out.loss.backward()
            opt.step()
            run.append(out.loss.item())
        losses.append(run)
    # the losses after 4 AdamW steps agree to 1e-4 relative (f32 noise grows through the steps)
    for a, b in zip(*losses):
        assert abs(a - b) < 1e-4 * abs(a), losses
    assert losses[1][-1] < losses[1][0]  # and they did train


def test_generate_matches():
    stock = tiny("mixtral")
    mine = copy.deepcopy(stock)
    dmoe.hf.replace_moe_blocks(mine)
    ids = tokens(n=1, s=5, seed=3)
    a = stock.generate(ids, max_new_tokens=6, do_sample=False)
    b = mine.generate(ids, max_new_tokens=6, do_sample=False)  # T = 1 per step after the prompt
    assert torch.equal(a, b)


def test_replace_after_a_forward_records_router_logits():
    # transformers installs its output-recording hooks at the first forward; blocks replaced later still report
    stock = tiny("mixtral")
    ids = tokens()
    with torch.no_grad():
        a = stock(ids, output_router_logits=True)
        dmoe.hf.replace_moe_blocks(stock)
        b = stock(ids, output_router_logits=True)
    assert len(b.router_logits) == 2
    assert abs(float(b.aux_loss) - float(a.aux_loss)) < 1e-5 * abs(float(a.aux_loss))


def test_unsupported_activation_is_refused():
    cfg = tr.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, hidden_act="gelu")
    model = tr.MixtralForCausalLM(cfg)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        dmoe.hf.replace_moe_blocks(model)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_restore_after_training(kind):
    model = tiny(kind).train()
    dmoe.hf.replace_moe_blocks(model)
    ids = tokens(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(2):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        trained = model(ids, output_router_logits=True)
    assert dmoe.hf.restore_moe_blocks(model) == 2
    assert not any(isinstance(m, dmoe.hf.DmoeSparseMoeBlock) for m in model.modules())
    keys = set(model.state_dict())
    assert any(k.endswith("mlp.experts.gate_up_proj") or k.endswith("experts.0.w1.weight")
               or k.endswith("experts.0.gate_proj.weight") for k in keys), sorted(keys)[:20]
    with torch.no_grad():
        back = model(ids, output_router_logits=True)
    assert rel(back.logits, trained.logits) < TOL  # the stock blocks hold the trained weights
    assert abs(float(back.aux_loss) - float(trained.aux_loss)) < 1e-5 * abs(float(trained.aux_loss))


def test_replace_refuses_what_cannot_run_and_replaces_nothing():
    # Python API bad-input pass (docs/faults.md): a float64 (or bf16) model on the CPU, or a layer argument the engine
    # refuses, was replaced block by block and failed at its first forward, the model left with dmoe blocks;
    # replace_moe_blocks(None) was an AttributeError.
    model = tiny("mixtral")
    blocks = lambda m: [type(b).__name__ for n, b in m.named_modules() if n.endswith("mlp")]  # noqa: E731
    stock = blocks(model)
    with pytest.raises(ValueError, match=r"holds torch.float64 weights on cpu, and engine 'cpu' computes in float32"):
        dmoe.hf.replace_moe_blocks(model.double())
    assert blocks(model) == stock
    model.float()
    with pytest.raises(ValueError, match="capacity_factor = nan is invalid"):
        dmoe.hf.replace_moe_blocks(model, capacity_factor=float("nan"))
    assert blocks(model) == stock
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        dmoe.hf.replace_moe_blocks(None)
    assert dmoe.hf.replace_moe_blocks(model) == 2
