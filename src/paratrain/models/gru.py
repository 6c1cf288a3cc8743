"""A sequence model over token ids: an embedding, a GRU, and a linear head on the state after the last token.
A plain nn.Sequential, so a pipeline cuts it between its layers like any other."""

import torch
from torch import Tensor, nn


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: a batch-first GRU's gradient for its input is a
    transposed view, and a pipeline that cuts before the GRU sends that gradient to the stage before, which
    torch.distributed's send and receive refuse ("input tensor has to be contiguous")."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad.contiguous()


class LastState(nn.Module):
    """A GRU that returns only its state after the last token (N x width): nn.GRU returns a pair."""

    def __init__(self, width: int, depth: int, dropout: float) -> None:
        super().__init__()
        self.gru = nn.GRU(width, width, num_layers=depth, batch_first=True, dropout=dropout if depth > 1 else 0.0)

    def forward(self, x: Tensor) -> Tensor:
        _, last = self.gru(_ContiguousGradient.apply(x))  # depth x N x width
        return last[-1]


class GRUNet(nn.Sequential):
    def __init__(self, vocabulary: int, num_outputs: int, width: int = 64, depth: int = 1,
                 dropout: float = 0.0) -> None:
        super().__init__(nn.Embedding(vocabulary, width), LastState(width, depth, dropout),
                         nn.Linear(width, num_outputs))
