import torch
from torch.autograd import gradcheck

from hpctrain.bench.dlrm import _rounds, reference_logits
from hpctrain.config import ModelConfig
from hpctrain.models.dlrm import DLRM, DotInteraction, interaction_width


def test_shapes_and_widths_of_the_reference_architecture():
    config = ModelConfig(embedding_dim=16, bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1))
    model = DLRM(config, num_tables=26)
    assert interaction_width(26, 16) == 16 + 27 * 26 // 2 == 367
    assert model.top[0].in_features == 367
    logits = model(torch.randn(8, 13), torch.randn(8, 26, 16))
    assert logits.shape == (8,)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_interaction_is_the_pairwise_dot_product():
    model = DLRM(ModelConfig(embedding_dim=2, bottom_mlp=(2,), top_mlp=(1,)), num_tables=2)
    dense, emb = torch.randn(3, 13), torch.randn(3, 2, 2)
    x = model.bottom(dense)
    features = [x, emb[:, 0], emb[:, 1]]
    pairs = [(features[i] * features[j]).sum(1) for i in range(3) for j in range(i)]
    expected = model.top(torch.cat([x, torch.stack(pairs, 1)], 1)).squeeze(1)
    torch.testing.assert_close(model(dense, emb), expected)


def test_interaction_gradient_is_autograds_of_the_plain_products():
    """The interaction's own backward (one gather into the symmetric gradient grid, its
    diagonal zeroed, one bmm) against autograd through bmm and index_select, and
    numerically (gradcheck, float64); in float32 its grid holds the bits of one built by
    scattering each pair's gradient into its cell and its mirror's."""
    interaction = DotInteraction(4)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(5, 4, 3, dtype=torch.float64, requires_grad=True)
    gradcheck(interaction, (x, emb))
    weights = torch.randn(5, interaction_width(4, 3), dtype=torch.float64)
    (interaction(x, emb) * weights).sum().backward()
    ours = x.grad.clone(), emb.grad.clone()
    x.grad = emb.grad = None
    features = torch.cat([x.unsqueeze(1), emb], dim=1)
    lower = interaction.lower.squeeze(0)
    plain = torch.bmm(features, features.transpose(1, 2)).flatten(1).index_select(1, lower)
    (torch.cat([x, plain], dim=1) * weights).sum().backward()
    torch.testing.assert_close(ours, (x.grad, emb.grad))

    features = features.detach().float().requires_grad_()
    grad = torch.randn(5, len(lower))
    pairs_only = torch.autograd.grad(
        (interaction(features[:, 0], features[:, 1:])[:, 3:] * grad).sum(), features)[0]
    mirror = (lower % 5) * 5 + lower // 5
    grid = grad.new_zeros(5, 25).index_add_(1, lower, grad).index_add_(1, mirror, grad)
    assert torch.equal(pairs_only, torch.bmm(grid.view(5, 5, 5), features.detach()))


def test_the_torch_baseline_computes_the_same_model_the_references_way():
    """bench dlrm's plain-torch step runs hpctrain's layers as the reference does: the same
    logits, bit for bit, and the same gradients up to rounding."""
    model = DLRM(ModelConfig(), num_tables=26)
    dense, emb = torch.randn(64, 13), torch.randn(64, 26, 16, requires_grad=True)
    ours = model(dense, emb)
    ours.sum().backward()
    grads = [emb.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    model.zero_grad()
    emb.grad = None
    theirs = reference_logits(model, dense, emb)
    assert torch.equal(ours, theirs)
    theirs.sum().backward()
    torch.testing.assert_close(grads, [emb.grad, *(p.grad for p in model.parameters())])


def test_bench_dlrm_runs_every_other_round_in_reverse_after_a_warm_up_round():
    """No case always runs after the same one (the traced step beside the untraced one, in
    both orders), and the warm-up round is not counted."""
    order = []

    def case(name):
        def run(steps):
            order.append(name)
            return steps * (len(order) + 0.5)  # seconds: the call's place, half a step on
        return run

    cases = {name: case(name) for name in ("a", "a traced", "b")}
    times = _rounds(cases, rounds=2, steps=4)
    assert order == ["b", "a traced", "a", "a", "a traced", "b", "b", "a traced", "a"]
    assert times == {"a": [4.5, 9.5], "a traced": [5.5, 8.5], "b": [6.5, 7.5]}
