"""Sparse inputs (issue 42, item 4): a graph convolution taking a sparse COO adjacency is refused
up front, by the input's name, instead of failing deep in the profile; and the capture check's
one-sample slice never cuts a tensor that is not strided. Each test failed before its fix."""
import pytest
import torch
import torch.nn as nn

from remat.planner.capture.check import _first_sample
from remat import InputLayoutError
from remat.runtime import plan_and_wrap

from helpers import FAST


class GCN(nn.Module):
    """Two graph convolutions over a sparse adjacency whose rows are the nodes (the batch)."""

    def __init__(self, d=16, h=32):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, h), nn.Linear(h, 4)

    def forward(self, x, adj):
        h = torch.relu(torch.sparse.mm(adj, self.l1(x)))
        return torch.sparse.mm(adj, self.l2(h))


def _graph(n=50, edges=200):
    torch.manual_seed(0)
    idx = torch.randint(0, n, (2, edges))
    return torch.randn(n, 16), torch.sparse_coo_tensor(idx, torch.rand(edges), (n, n)).coalesce()


def test_a_sparse_input_is_refused_by_name():
    x, adj = _graph()
    model = GCN()
    with pytest.raises(InputLayoutError, match=r"example input adj is a sparse_coo tensor.*to_dense"):
        plan_and_wrap(model, 1.0, example_inputs=(x, adj), loss_fn=lambda out: out.square().mean(), options=FAST)
    with pytest.raises(InputLayoutError, match=r"example input adj\['a'\] is a sparse_csr tensor"):
        plan_and_wrap(GCN(), 1.0, example_inputs=(x,), example_kwargs={"adj": {"a": adj.to_sparse_csr()}},
                      loss_fn=lambda out: out.square().mean(), options=FAST)
    assert model(x, adj).shape == (50, 4)       # the model as it was: unwrapped, it runs


def test_the_checks_slice_never_cuts_a_tensor_that_is_not_strided():
    x, adj = _graph()
    assert _first_sample((x, adj), {}) is None                  # the inputs as given instead
    (cut, dense), _ = _first_sample((x, adj.to_dense()), {})    # dense, both are cut to one sample
    assert cut.shape == (1, 16) and dense.shape == (1, 50)
