import pytest
import torch

from hpctrain.train.optim import DenseOptimizer


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_matches_torch_optim(kind):
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    mine = DenseOptimizer(ours.parameters(), kind)
    reference = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[kind](
        theirs.parameters(), lr=0.3)
    for _ in range(4):
        x = torch.randn(8, 5)
        for model in (ours, theirs):
            model.zero_grad()
            (model(x) ** 2).sum().backward()
        mine.step(lr=0.3)
        reference.step()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
