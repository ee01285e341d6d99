"""The mixture-of-experts feed-forward on one process: routing, dropless dispatch, balancing, the GPT around it.

Every expected value is computed apart from the module under test: token by token with the experts' weights,
or from the formulas of the papers (Switch Transformer's f·P, ST-MoE's z-loss, DeepSeek-V3's bias update).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megascale.core.config import GPTConfig, MoEConfig
from megascale.core.model.gpt import GPT, flops_per_token
from megascale.core.model.moe import MoE, expert_load, update_expert_biases

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, pad_vocab_to_multiple_of=64)


def _config(**moe: object) -> GPTConfig:
    fields = dict(num_experts=4, top_k=2, expert_hidden=48)
    fields.update(moe)
    return GPTConfig(**SMALL, moe=MoEConfig(**fields))  # type: ignore[arg-type]


def _layer(config: GPTConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return GPT(config).blocks["0"].moe  # type: ignore[return-value]


def _token_by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts, one at a time, straight from the weights."""
    moe = layer.router.moe
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = (layer.router.weight @ token).float()
        scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        bias = layer.router.expert_bias if layer.router.expert_bias is not None else 0
        chosen = (scores + bias).topk(moe.top_k).indices
        weights = scores[chosen] / (scores[chosen].sum() if moe.normalize_top_k else 1)
        y = torch.zeros_like(token)
        for e, w in zip(chosen.tolist(), weights, strict=True):
            ex = layer.experts
            hidden = F.silu(ex.gate[e] @ token) * (ex.up[e] @ token)
            y = y + w * (ex.down[e] @ hidden)
        if layer.shared is not None:
            y = y + layer.shared(token[None])[0]
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {"top_k": 1},
        {"top_k": 4, "normalize_top_k": False},
        {"score": "sigmoid", "shared_experts": 1},
        {"bias_update_rate": 0.1},
    ],
    ids=["top2", "top1", "all-unnormalised", "sigmoid-shared", "biased"],
)
def test_every_token_gets_the_weighted_sum_of_its_chosen_experts(moe: dict) -> None:
    layer = _layer(_config(**moe))
    if layer.router.expert_bias is not None:  # a bias that changes the choice, never the weights
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(3, 10, 32)
    torch.testing.assert_close(layer(x), _token_by_token(layer, x), rtol=1e-5, atol=1e-6)


def test_no_token_is_dropped_when_every_token_picks_the_same_expert() -> None:
    layer = _layer(_config(top_k=1))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0  # expert 2 wins for any input with a positive sum
    x = torch.rand(2, 8, 32) + 0.1
    torch.testing.assert_close(layer(x), _token_by_token(layer, x), rtol=1e-5, atol=1e-6)
    assert layer.router.tokens_per_expert.tolist() == [0, 0, 16, 0]  # a module starts in training mode
    layer.eval()
    layer(x)
    assert layer.router.tokens_per_expert.tolist() == [0, 0, 16, 0]


def test_the_balancing_loss_is_switch_transformers_f_times_p_per_sequence_and_the_z_loss_st_moes() -> None:
    layer = _layer(_config(aux_loss_coef=0.5, z_loss_coef=0.25))
    layer.train()
    x = torch.randn(2, 6, 32)
    layer(x)
    got = layer.pending_loss
    want = 0.0
    for seq in x:
        logits = seq @ layer.router.weight.T
        probs = logits.softmax(-1)
        chosen = probs.topk(2).indices
        f = torch.stack([(chosen == e).any(-1).float().sum() for e in range(4)]) * 4 / (2 * 6)
        want += 0.5 * (f * probs.mean(0)).sum() / 2
    logits = x.reshape(-1, 32) @ layer.router.weight.T
    want += 0.25 * logits.logsumexp(-1).square().mean()
    assert got is not None
    torch.testing.assert_close(got, want)


def test_the_loss_and_gradients_of_a_batch_are_the_mean_of_its_halves_as_data_parallelism_needs() -> None:
    """Sequence-wise balancing makes the loss a mean over sequences: two data-parallel replicas averaging their
    gradients get exactly the union batch's (a batch-wide f·P would not split)."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(_config(aux_loss_coef=0.1, z_loss_coef=0.01), n_layers=1))
    tokens = torch.randint(0, 64, (4, 16))

    def grads(batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = model(batch, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = grads(tokens)
    first, first_grads = grads(tokens[:2])
    second, second_grads = grads(tokens[2:])
    torch.testing.assert_close(whole, (first + second) / 2)
    for w, a, b in zip(whole_grads, first_grads, second_grads, strict=True):
        torch.testing.assert_close(w, (a + b) / 2, rtol=1e-4, atol=1e-6)


def test_the_gpt_adds_the_balancing_losses_when_training_only() -> None:
    torch.manual_seed(0)
    config = _config(aux_loss_coef=0.1)
    model = GPT(config)
    tokens = torch.randint(0, 64, (2, 16))
    model.eval()
    plain = model(tokens, tokens)
    model.train()
    left: list[torch.Tensor] = []
    layers = [b.moe for b in model.blocks.values()]
    for layer in layers:
        layer.register_forward_hook(lambda m, args, out: left.append(m.pending_loss.detach()))
    with_aux = model(tokens, tokens)
    assert len(left) == 2 and all(loss > 0 for loss in left)
    torch.testing.assert_close(with_aux - plain, left[0] + left[1])
    assert all(layer.pending_loss is None for layer in layers)  # taken, not left for the next step


def test_tokens_are_counted_once_under_activation_checkpointing_and_not_in_eval() -> None:
    layer = _layer(_config())
    layer.train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # the forward runs twice
    assert layer.router.tokens_per_expert.sum().item() == 2 * 8 * 2
    layer.eval()
    layer(x)
    assert layer.router.tokens_per_expert.sum().item() == 2 * 8 * 2


def test_loss_free_balancing_moves_biases_toward_the_underloaded_experts_and_restarts_the_counts() -> None:
    torch.manual_seed(0)
    model = GPT(_config(bias_update_rate=0.01, aux_loss_coef=0.0))
    router = model.blocks["0"].moe.router
    router.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    counts = update_expert_biases(model)
    assert counts is not None and counts[0].tolist() == [10.0, 2.0, 4.0, 0.0]
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    assert router.tokens_per_expert.sum().item() == 0
    load = expert_load(model)
    assert load is not None and load.shape == (2, 4)


def test_a_gpt_built_on_meta_and_initialised_equals_a_direct_build() -> None:
    config = _config(bias_update_rate=0.01, shared_experts=1)
    torch.manual_seed(3)
    direct = GPT(config)
    torch.manual_seed(3)
    with torch.device("meta"):
        late = GPT(config)
    late.to_empty(device="cpu")
    late.init_weights()
    for (name, a), (_, b) in zip(direct.state_dict().items(), late.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(late.blocks["0"].moe.router.tokens_per_expert, torch.zeros(4))
    # output projections (each expert's down) are scaled like a dense MLP's
    down, gate = direct.blocks["0"].moe.experts.down, direct.blocks["0"].moe.experts.gate
    assert down.std().item() < 0.75 * gate.std().item()


def test_one_expert_chosen_by_every_token_is_the_dense_mlp() -> None:
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**SMALL, ffn_hidden=48, parallel_block=False))
    moe = GPT(
        GPTConfig(**SMALL, parallel_block=False, moe=MoEConfig(num_experts=1, top_k=1, expert_hidden=48))
    )
    state = dense.state_dict()
    for i in range(2):
        mlp = f"blocks.{i}.mlp"
        for name in ("gate", "up", "down"):
            kind = "out_proj" if name == "down" else "in_proj"
            state[f"{mlp}.experts.{name}"] = state.pop(f"{mlp}.{kind}.{name}.weight")[None]
        state[f"{mlp}.router.weight"] = torch.zeros(1, 32)
    moe.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(moe(tokens), dense(tokens))


def test_flops_count_active_parameters() -> None:
    config = _config(shared_experts=1)
    model = GPT(config)
    total, active = model.num_parameters(), model.num_parameters(active=True)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total - active == experts // 2  # top 2 of 4 experts
    embedding = model.embed.weight.numel()
    # 6·N over the matmul parameters (all but the embedding, the norms aside) plus attention's scores
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    attention = flops_per_token(config, 16) - 6.0 * (active - embedding - norms)
    assert attention == pytest.approx(12.0 * 32 * 2 * (16 + 1) / 2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_experts=0), "num_experts=0 must be >= 1"),
        (dict(num_experts=4, top_k=5), "top_k=5 must be between 1 and num_experts=4"),
        (dict(num_experts=4, score="relu"), "score='relu' must be 'softmax' or 'sigmoid'"),
        (dict(num_experts=4, aux_loss_coef=-1), "aux_loss_coef=-1 must be >= 0"),
    ],
)
def test_a_wrong_moe_config_is_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoEConfig(**fields)  # type: ignore[arg-type]


def test_a_saved_config_holds_the_moe_as_a_dict_and_reads_it_back() -> None:
    config = _config(shared_experts=1)
    again = GPTConfig(**config.to_dict())
    assert again.moe == config.moe
    with pytest.raises(ValueError, match="moe has unknown keys"):
        GPTConfig(**{**config.to_dict(), "moe": {"num_experts": 2, "experts": 3}})
