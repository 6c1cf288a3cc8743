"""Sampling text from a trained language model: the built-in gpt, or a network of the user's (a Hugging Face
causal LM, say) that gives N x T x V scores for N x T token ids.

    load_generator(run) -> TextGenerator: .generate(prompt, tokens=40, temperature=1.0, top_k=None, seed=0)

The loop is the plain one (nanoGPT's `generate`): the last `context` tokens in, the scores of the last
position, divided by the temperature (0: always the likeliest token), cut to the k likeliest, one token drawn,
appended; no key-value cache (the models here are small; a long generation reads its whole window at each
token). The prompt is encoded, and the tokens decoded, by the tokenizer the run's text was read with (its
checkpoint names it), or one given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import UserError
from ..data.tokenizers import Tokenizer, tokenizer_for
from .trained import check_callables, loaded, run_of, user_facing


def sample(model: nn.Module, ids: torch.Tensor, tokens: int, context: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """`ids` (a 1-D tensor of token ids) followed by `tokens` more drawn from `model`."""
    import math

    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"the temperature (--temperature) must be 0 (the likeliest token) or a finite number above, "
                        f"not {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k (--top-k) must be at least 1, not {top_k}")
    if tokens < 0:
        raise UserError(f"tokens (--tokens) must be 0 or more, not {tokens}")
    out = ids.clone()
    with torch.no_grad():
        for _ in range(tokens):
            window = out[-context:].unsqueeze(0)
            scores = model(window)
            if not (isinstance(scores, torch.Tensor) and scores.dim() == 3 and scores.shape[1] == window.shape[1]):
                got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise UserError(f"the network gave {got} for 1 sequence; generation needs its scores for every "
                                "token of the vocabulary at every position, 1 x T x V")
            last = scores[0, -1].float()
            if temperature == 0:
                token = last.argmax()
            else:
                last = last / temperature
                if top_k is not None and top_k < len(last):
                    last[last < last.topk(top_k).values[-1]] = -float("inf")
                token = torch.multinomial(last.softmax(-1), 1, generator=generator)[0]
            out = torch.cat([out, token.reshape(1)])
    return out


class TextGenerator:
    """A trained language model, in eval mode on the CPU, with its tokenizer and the longest sequence it reads."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None, context: int, vocabulary: int) -> None:
        self.model, self.tokenizer, self.context, self.vocabulary = model.eval(), tokenizer, context, vocabulary

    def generate(self, prompt: str | list[int] | torch.Tensor, tokens: int = 40, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0) -> str | list[int]:
        """The prompt and its continuation of `tokens` tokens: text for a text prompt (decoded by the run's
        tokenizer), token ids for token ids."""
        as_text = isinstance(prompt, str)
        if as_text and self.tokenizer is None:
            raise UserError("this run was not trained on text, so its tokenizer is unknown: give the prompt as token "
                            "ids, or name the tokenizer (paratrain generate --tokenizer NAME)")
        ids = torch.as_tensor(self.tokenizer.encode(prompt.encode("utf-8")) if as_text else prompt,
                              dtype=torch.long).reshape(-1)
        if not len(ids):
            raise UserError("the prompt is empty: give it at least one character (or token)")
        if int(ids.max()) >= self.vocabulary or int(ids.min()) < 0:
            raise UserError(f"the prompt's token ids reach {int(ids.max())}; this model knows 0..{self.vocabulary - 1}")
        out = sample(self.model, ids, tokens, self.context, temperature, top_k, torch.Generator().manual_seed(seed))
        return self.tokenizer.decode(out.tolist()) if as_text else out.tolist()


@user_facing
def load_generator(run: str | Path, model: Callable[[], nn.Module] | None = None, ema: bool = False,
                   tokenizer: str | None = None) -> TextGenerator:
    """A run's language model ready to sample from (its last checkpoint, or a .pt file): the built-in gpt, or a
    network of yours (give its factory, `model=`, as to paratrain.load_model). `tokenizer`: for a run not
    trained on text (tensors of token ids), the tokenizer its ids came from."""
    from ..checkpoint import files as checkpoint

    check_callables(model=model)
    run = run_of(run)
    state = checkpoint.load(run)
    info = state.get("data") or {}
    if info.get("kind", "images") == "images" or len(info.get("input_shape", [])) != 1 or \
            "int" not in str(info.get("input_dtype")):
        raise UserError(f"{run} did not train a model over token ids (its inputs are "
                        f"{info.get('kind', 'images')}); generation is for language models")
    net = loaded(run, state, model, ema)[0]
    text = info.get("text") or {}
    name = tokenizer or text.get("tokenizer")
    context = int(text.get("context") or info["input_shape"][0])
    return TextGenerator(net, tokenizer_for(name) if name else None, context, int(info.get("vocabulary") or 0) or
                         _vocabulary(net))


def _vocabulary(net: nn.Module) -> int:
    """The vocabulary a network's token embedding knows (a checkpoint without the data's record of it)."""
    embedding = next((m for m in net.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise UserError("the network has no token embedding: which token ids it reads is unknown")
    return embedding.num_embeddings


__all__: list[Any] = ["TextGenerator", "load_generator", "sample"]
