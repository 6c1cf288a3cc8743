"""A sequence model over token ids: an embedding, a GRU, and a linear head on the state after the last token.
A plain nn.Sequential, so a pipeline cuts it between its layers like any other."""

from torch import Tensor, nn


class LastState(nn.Module):
    """A GRU that returns only its state after the last token (N x width): nn.GRU returns a pair."""

    def __init__(self, width: int, depth: int, dropout: float) -> None:
        super().__init__()
        self.gru = nn.GRU(width, width, num_layers=depth, batch_first=True, dropout=dropout if depth > 1 else 0.0)

    def forward(self, x: Tensor) -> Tensor:
        _, last = self.gru(x)  # depth x N x width
        return last[-1]


class GRUNet(nn.Sequential):
    def __init__(self, vocabulary: int, num_outputs: int, width: int = 64, depth: int = 1,
                 dropout: float = 0.0) -> None:
        super().__init__(nn.Embedding(vocabulary, width), LastState(width, depth, dropout),
                         nn.Linear(width, num_outputs))
