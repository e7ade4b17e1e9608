import torch

from hpctrain.config import ModelConfig
from hpctrain.models.dlrm import DLRM, interaction_width


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
