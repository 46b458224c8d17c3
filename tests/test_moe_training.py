"""A GPT whose MLPs are mixtures of experts (GPTConfig.n_expert), trained in every layout.

The model: its parameter count is the formula's; the balance loss that rides on each layer's output
(moe.with_balance_loss) gives the gradients of cross-entropy + the layers' balance losses, times
aux_scale. Training: losses and weights equal the single-process run with expert parallelism inside
the DP group (ep 2, 3, and 2 of 4 DP ranks), with micro-batches, recomputation, a pipeline, tensor
parallelism, uneven DP shares, torch's collectives, clipping (the same gradient norms), capacity
(dropped tokens), SwiGLU experts with DeepSeek-V3's biases, ZeRO 1 and 3 without EP, and an expert
no token reaches (it works and does not move); bf16 keeps to the 16-bit bounds; a checkpoint
resumes across EP layouts; the counts exchanged are the formula's; what does not combine yet is
refused before any process starts.
"""
import dataclasses

import pytest
import torch
from reference import assert_same_training, flat, rel_diff

import minipar
from minipar import checkpoint, moe
from minipar.config import ParallelConfig
from minipar.model import GPT, cross_entropy

MOE = minipar.GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=96, seq_len=24, n_expert=6,
                        top_k=2)
KW = dict(steps=3, global_batch=12, lr=1e-3, weight_decay=0.1, seed=0, return_state=True)


def test_the_parameter_count_is_the_formula():
    for cfg in (MOE, MOE.replace(mlp="swiglu", top_k=1), MOE.replace(n_expert=1, top_k=1),
                minipar.GPTConfig.preset("llama-tiny", n_expert=4, tie_embeddings=True)):
        assert cfg.num_params == sum(p.numel() for p in GPT(cfg).parameters())
    dense = MOE.replace(n_expert=0)   # the flops a token: its k experts and the router
    assert MOE.layer_matrices - dense.layer_matrices == dense.mlp_matrices + 32 * 6


def test_the_balance_loss_joins_the_gradient_scaled_by_aux_scale():
    torch.manual_seed(0)
    model, x = GPT(MOE), torch.randint(0, 96, (3, 24))
    losses = []
    for block in model.blocks:
        block.mlp.register_forward_hook(lambda m, i, out: losses.append(out[1].balance_loss))

    def grads(aux_scale, explicit):
        losses.clear()
        model.zero_grad()
        moe.set_aux_scale(model, aux_scale)
        loss = cross_entropy(model(x), x)
        (loss + explicit * sum(losses)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    riding, written = grads(3.0, 0.0), grads(0.0, 3.0)
    assert rel_diff(riding, written) < 1e-6
    assert rel_diff(grads(0.0, 0.0), written) > 1e-4   # the balance loss does move the router


@pytest.fixture(scope="module")
def reference():
    return minipar.train(MOE, ParallelConfig(), **KW)


LAYOUTS = [ParallelConfig(dp=2, ep=2), ParallelConfig(dp=3, ep=3),
           ParallelConfig(dp=4, ep=2, dp_mode="naive"),
           ParallelConfig(dp=2, ep=2, microbatches=2, recompute="full"),
           ParallelConfig(dp=2, ep=2, pp=2, microbatches=2),
           ParallelConfig(dp=2, ep=2, tp=2), ParallelConfig(dp=2, ep=2, dp_shares=(4, 8)),
           ParallelConfig(dp=2, ep=2, collectives="torch"), ParallelConfig(dp=2, zero=1),
           ParallelConfig(dp=2, zero=3, microbatches=2)]


@pytest.mark.parametrize("par", LAYOUTS, ids=[par.label for par in LAYOUTS])
def test_training_a_mixture_of_experts_is_the_single_process_run(par, reference):
    res = minipar.train(MOE, par, **KW)
    assert_same_training(res, reference)
    layers = MOE.n_layer // par.pp   # this rank's
    forwards = KW["steps"] * par.microbatches * layers * (2 if par.recompute == "full" else 1)
    counts = forwards * (par.ep - 1) * (MOE.n_expert // par.ep) * 8   # int64 counts to the others
    for sent in res.comm_bytes:
        assert sent.get("ep_counts", 0) == counts
        if par.recompute == "none":   # rows out and back, reversed in backward (a, b: 2a + b)
            assert sent.get("ep_dispatch", 0) == sent.get("ep_combine", 0)
        assert (sent.get("ep_dispatch", 0) > 0) == (par.ep > 1)


@pytest.mark.parametrize("cfg,par,extra", [
    (MOE.replace(capacity_factor=0.5), ParallelConfig(dp=2, ep=2, microbatches=2), {}),
    (MOE.replace(mlp="swiglu", moe_bias_speed=1e-2), ParallelConfig(dp=2, ep=2, microbatches=2),
     {}),
    (MOE, ParallelConfig(dp=2, ep=2, pp=2), dict(clip=0.05))],
    ids=["capacity", "swiglu-bias", "clip"])
def test_capacity_biases_and_clipping_train_the_same_in_an_expert_parallel_layout(cfg, par, extra):
    ref = minipar.train(cfg, ParallelConfig(), **KW, **extra)
    res = minipar.train(cfg, par, **KW, **extra)
    assert_same_training(res, ref)
    if extra:   # clipped: the global norm, summed over the EP ranks' different experts, is one
        assert max(abs(a - b) / b for a, b in zip(res.grad_norms, ref.grad_norms)) < 1e-5
        assert all(n > extra["clip"] for n in ref.grad_norms)
    if cfg.moe_bias_speed:
        assert any(v.abs().max() > 0 for k, v in ref.state_dict.items() if "select_bias" in k)


def test_an_expert_that_no_token_reaches_trains_and_stays_put(tmp_path):
    torch.manual_seed(KW["seed"])
    model = GPT(MOE)
    for block in model.blocks:
        block.mlp.select_bias[3] = -10.0   # expert 3 is never among a token's top 2
    start = dict(format=checkpoint.FORMAT, model=model.state_dict(), optimizer={}, steps_done=0,
                 config=dataclasses.asdict(MOE))
    path = tmp_path / "starved.pt"
    torch.save(start, path)
    kw = dict(KW, weight_decay=0.0, resume=str(path))   # (decay would move it without a gradient)
    ref = minipar.train(MOE, ParallelConfig(), **kw)
    res = minipar.train(MOE, ParallelConfig(dp=2, ep=2), **kw)
    assert_same_training(res, ref)
    for name in ("fc", "fc_bias", "proj", "proj_bias"):
        key = f"blocks.0.mlp.{name}"
        assert torch.equal(res.state_dict[key][3], start["model"][key][3])
        assert not torch.equal(res.state_dict[key][2], start["model"][key][2])


def test_a_checkpoint_resumes_from_one_expert_parallel_layout_in_another(tmp_path, reference):
    path = str(tmp_path / "ep.pt")
    minipar.train(MOE, ParallelConfig(dp=2, ep=2, microbatches=2), **{**KW, "steps": 2}, save=path)
    rest = minipar.train(MOE, ParallelConfig(dp=3, ep=3), **KW, resume=path)
    assert len(rest.losses) == 1 and rest.losses[0] == pytest.approx(reference.losses[2], rel=1e-5)
    assert rel_diff(flat(rest.state_dict), flat(reference.state_dict)) <= 1e-5


def test_expert_parallelism_in_bf16_keeps_to_the_16_bit_bounds():
    # test_precision_dp's bounds: losses within 1e-4, the whole model within 2e-3
    ref = minipar.train(MOE, ParallelConfig(precision="bf16"), **KW)
    got = minipar.train(MOE, ParallelConfig(precision="bf16", dp=2, ep=2), **KW)
    assert max(abs(a - b) / b for a, b in zip(got.losses, ref.losses)) < 1e-4
    assert rel_diff(flat(got.state_dict), flat(ref.state_dict)) < 2e-3


@pytest.mark.parametrize("par,cfg,message", [
    (dict(dp=2, ep=2), MOE.replace(n_expert=0), "needs a mixture of experts"),
    (dict(dp=3, ep=2), MOE, "must divide dp \\(3"), (dict(dp=4, ep=4), MOE, "n_expert \\(6\\)"),
    (dict(dp=2, ep=2, zero=1), MOE, "not yet with ZeRO"),
    (dict(cp=2), MOE, "cp > 1 or sequence_parallel"),
    (dict(tp=2, sequence_parallel=True), MOE, "cp > 1 or sequence_parallel")])
def test_a_layout_that_cannot_work_is_refused_before_any_process(par, cfg, message):
    with pytest.raises(ValueError, match=message):
        minipar.train(cfg, ParallelConfig(**par), steps=1, global_batch=12)


def test_a_model_that_cannot_route_is_refused():
    with pytest.raises(ValueError, match="top_k must be an integer from 1 to n_expert"):
        MOE.replace(top_k=7)
    with pytest.raises(ValueError, match="capacity_factor must be a positive number or None"):
        MOE.replace(capacity_factor=0)
