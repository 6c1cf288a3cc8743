"""The built-in decoder-only transformer (--model gpt): token and position embeddings, `depth` pre-norm blocks
of causal self-attention (torch's scaled_dot_product_attention) and an MLP, a last norm and a linear head:
N x T token ids in, N x T x V scores out.

It is an nn.Sequential of [embedding, block, ..., block, norm, head], so a pipeline cuts it between any two of
those as it cuts any Sequential. The projections are separate Linear layers (query, key, value and output;
the MLP's two), the layout tensor parallelism shards (column-wise then row-wise), and without biases (as
LLaMA's): a key's bias has a gradient of exactly 0 in exact arithmetic (a softmax does not see a constant
added to all its scores), and Adam turns that gradient's rounding noise into steps of the full learning rate,
which would part 2 workers from 1 device in the last bits. The head is not tied to the
token embedding: tied, one weight would live in the first and the last pipeline stage.

A packed batch (data/packing.py: {"input_ids", "position_ids"}, several examples to a row, each example's
positions counted from 0) runs with each example at its own positions and attention kept within it (`documents`);
the blocks then take the mask beside their input, so such a batch runs on the whole model (not cut into a
pipeline's stages).

Dropout (0 by default, as for pre-training today) is on the embeddings' sum and on each residual branch, through
nn.Dropout, never inside the attention kernel: features/dropout.py then draws every mask as one device
would, whatever the number of workers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INIT_STD = 0.02  # GPT-2's


class NormalLinear(nn.Linear):
    """A linear layer without bias whose weights are drawn from N(0, std^2) (GPT-2's initialisation) by its own
    reset_parameters: a layer draws its weights alone, as a model built in shards draws them (components/initial.py)."""

    def __init__(self, inputs: int, outputs: int, std: float = INIT_STD) -> None:
        self.std = std  # (before nn.Linear's constructor, which draws the weights)
        super().__init__(inputs, outputs, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)


class NormalEmbedding(nn.Embedding):
    """An embedding drawn from N(0, INIT_STD^2) by its own reset_parameters (as NormalLinear)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)


class Embedding(nn.Module):
    """Token plus position embeddings (positions up to `context`), then dropout."""

    def __init__(self, vocabulary: int, context: int, width: int, dropout: float) -> None:
        super().__init__()
        self.tokens = NormalEmbedding(vocabulary, width)
        self.positions = NormalEmbedding(context, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: Tensor, positions: Tensor | None = None) -> Tensor:
        if ids.shape[1] > self.positions.num_embeddings:
            raise ValueError(f"a sequence of {ids.shape[1]} tokens; this model reads at most "
                             f"{self.positions.num_embeddings} (its --context)")
        where = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
        return self.dropout(self.tokens(ids) + self.positions(where))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, out_std: float = INIT_STD) -> None:
        super().__init__()
        self.head_width = width // heads
        self.query, self.key, self.value = (NormalLinear(width, width) for _ in range(3))
        self.out = NormalLinear(width, width, out_std)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """`mask`: N x 1 x T x T, where a position may attend (`documents`); None: causal."""
        n, t, _ = x.shape
        # N x T x W -> N x heads x T x head width; the heads counted from the projection's width, so that a
        # projection sharded by heads (tensor parallelism) runs its own heads
        q, k, v = (f(x).view(n, t, -1, self.head_width).transpose(1, 2) for f in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int, down_std: float = INIT_STD) -> None:
        super().__init__()
        self.up = NormalLinear(width, 4 * width)
        self.down = NormalLinear(4 * width, width, down_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): pre-norm, each branch's output dropped out; a branch's last
    layer drawn with the standard deviation `out_std` (GPT-2's 1/sqrt(2 x depth) of the others')."""

    def __init__(self, width: int, heads: int, dropout: float, out_std: float = INIT_STD) -> None:
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(width), Attention(width, heads, out_std)
        self.norm2, self.mlp = nn.LayerNorm(width), MLP(width, out_std)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.dropout(self.attention(self.norm1(x), mask))
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Sequential):
    def __init__(self, vocabulary: int, context: int, width: int = 128, depth: int = 2, heads: int | None = None,
                 dropout: float = 0.0) -> None:
        heads = heads or max(1, width // 64)
        if width % heads:
            raise ValueError(f"{heads} heads do not divide the width {width}")
        # every layer draws its own weights (components/initial.py draws them one layer at a time)
        residual = INIT_STD / math.sqrt(2 * max(depth, 1))
        super().__init__(Embedding(vocabulary, context, width, dropout),
                         *(Block(width, heads, dropout, residual) for _ in range(depth)),
                         nn.LayerNorm(width), NormalLinear(width, vocabulary))

    def forward(self, ids: Tensor | Mapping[str, Tensor]) -> Tensor:
        """Token ids (N x T) to scores (N x T x V); or a packed batch, {"input_ids", "position_ids"}."""
        if not isinstance(ids, Mapping):
            return super().forward(ids)
        positions = ids["position_ids"]
        x, mask = self[0](ids["input_ids"], positions), documents(positions)
        for block in list(self)[1:-2]:
            x = block(x, mask)
        return self[-1](self[-2](x))


def documents(positions: Tensor) -> Tensor:
    """Where each position of a packed batch may attend (N x 1 x T x T): the positions before it of its own
    example, an example beginning where the positions do not go up by one (as transformers finds packed
    sequences)."""
    begins = torch.diff(positions, dim=1, prepend=positions[:, :1] - 1) != 1
    example = begins.cumsum(dim=1)
    t = positions.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return ((example[:, :, None] == example[:, None, :]) & causal)[:, None]


def shape(model: nn.Module) -> dict[str, int] | None:
    """The gpt's depth, width and context (for its FLOPs a token), its heads, MLP hidden units and vocabulary
    (what tensor parallelism splits), or None for another network."""
    if not isinstance(model, GPT):
        return None
    embedding, depth = model[0], len(model) - 3
    width = embedding.tokens.embedding_dim
    heads = width // model[1].attention.head_width if depth else 1
    return {"depth": depth, "width": width, "context": embedding.positions.num_embeddings, "heads": heads,
            "hidden": 4 * width, "vocabulary": embedding.tokens.num_embeddings}
