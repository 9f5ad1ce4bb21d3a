"""'model:PATH': a smaller model with the same tokenizer drafts k tokens autoregressively, with its own
KV cache and its real probabilities (so rejection sampling stays exact when sampling).

Its cache follows the committed stream lazily (kv_cache.StreamCache): before each proposal the cache is trimmed
to the longest prefix it shares with the committed tokens, and only the tokens after that prefix are fed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quasar.decoding.drafters.base import Draft, DrafterOptions
from quasar.decoding.drafters.tree_proposal import Chance
from quasar.decoding.tree import DraftTree
from quasar.model.kv_cache import KVCache, StreamCache
from quasar.model.loading import LoadedModel
from quasar.model.source import ModelSource
from quasar.model.llama import Transformer
from quasar.decoding.sampling import SamplingParams, logits_to_probs, sample
from quasar.decoding.rejection import DenseDraft
from quasar.spec import MAX_DRAFT
from quasar.verifiers.registry import load_verifier


class ModelDrafter:
    free = False  # (Drafter)

    def __init__(self, model: Transformer, vocab_size: int, initial_len: int = 1024) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the verifier's V: draft probs are padded / cut to it
        self.stream = StreamCache(model, initial_len)
        self.tokens: list[int] = []  # the committed stream

    @property
    def cache(self) -> KVCache | None:
        return self.stream.cache

    def spawn(self) -> ModelDrafter:
        return ModelDrafter(self.model, self.vocab_size, self.stream.initial_len)

    def reset(self) -> None:
        self.tokens = []

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def rewind(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]  # the cache follows at the next proposal

    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        if k <= 0:
            return Draft([])
        cache = self.stream.ready(len(self.tokens) + k)
        feed = self.stream.follow(self.tokens)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.model(torch.tensor([feed], device=self.model.device), cache, last_only=True)[0, -1]  # [V_d]
            self.stream.fed(feed)
            probs = logits_to_probs(self.fit_vocab(logits), params)  # [V]
            token = int(probs.argmax()) if params.greedy else int(sample(probs, generator))
            tokens.append(token)
            rows.append(probs)
            feed = [token]
        return Draft(tokens, DenseDraft(torch.stack(rows)))  # probs [k, V]

    @torch.inference_mode()
    def propose_tree(self, nodes: int, width: int, chance: Chance) -> DraftTree:
        """Up to `nodes` tokens as a draft tree: the draft model's greedy chain, and beside each of its tokens the
        model's next likeliest ones (its top `width` at that position, distinct, as deterministic candidates), kept
        best first by P(node) = P(parent) * chance(depth, rank) (the shape does not depend on the tokens, so the
        chain runs only as deep as a kept node); at width 1 the greedy `propose` draft as a chain."""
        shape = tree_shape(nodes, width, chance)
        depth = max((d for d, _, _ in shape), default=0)
        if depth == 0:
            return DraftTree([], [])
        cache = self.stream.ready(len(self.tokens) + depth)
        feed = self.stream.follow(self.tokens)
        ranked: list[list[int]] = []  # [depth][rank]: the model's top tokens after the chain so far
        for _ in range(depth):
            logits = self.model(torch.tensor([feed], device=self.model.device), cache, last_only=True)[0, -1]  # [V_d]
            self.stream.fed(feed)
            ranked.append(self.fit_vocab(logits).topk(width).indices.tolist())
            feed = [ranked[-1][0]]
        chain: dict[int, int] = {}  # depth -> the node of the chain's token there
        tokens, parents, chances = [], [], []
        for d, r, estimate in shape:
            if r == 0:
                chain[d] = len(tokens)
            tokens.append(ranked[d - 1][r])
            parents.append(chain[d - 1] if d > 1 else -1)
            chances.append(estimate)
        return DraftTree(tokens, parents, chances)

    def fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V_d] -> [V]: cut padding rows, or pad with -inf when the drafter's vocab is smaller."""
        extra = self.vocab_size - logits.shape[-1]
        return logits[: self.vocab_size] if extra <= 0 else F.pad(logits, (0, extra), value=float("-inf"))


def check_same_tokenizer(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a drafter whose token ids mean different strings than the verifier's."""
    draft_vocab, target_vocab = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ValueError(
            f"the drafter {draft.source} does not share the verifier's tokenizer "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ); "
            "a model drafter needs the same tokenizer as the verifier"
        )


def build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> ModelDrafter:
    if not arg:
        raise ValueError("the model drafter needs a model: 'model:PATH' (a .gguf file or a model directory)")
    source = options.draft_model or ModelSource.of(arg)  # the entry resolves installed names; here a path
    # a quantized GGUF file drafts on its own blocks (a drafter's bytes per token decide what it costs), a float
    # model in bf16; both on quasar's fused kernels on the CPU
    draft = load_verifier(source, "gguf" if source.quantized_file else "bf16")
    check_same_tokenizer(draft, target)
    return ModelDrafter(draft.model, target.model.config.vocab_size)


def tree_shape(nodes: int, width: int, chance: Chance) -> list[tuple[int, int, float]]:
    """The best `nodes` places (depth, rank, P) of a chain with siblings beside each of its tokens, P = the chain's
    chances up to the parent times chance(depth, rank), best first; a place is kept only after the chain's place
    before it (its parent) and its sibling of the rank before it, so parents come before their children. Places of
    P 0 are left out."""
    places, reach = [], 1.0
    for depth in range(1, MAX_DRAFT + 1):
        places += [(-reach * chance(depth, rank), depth, rank) for rank in range(width)]
        reach *= chance(depth, 0)
    kept: list[tuple[int, int, float]] = []
    have = {(0, 0)}
    for minus, depth, rank in sorted(places):
        if len(kept) == nodes or minus >= 0:
            break
        if (depth - 1, 0) in have and (rank == 0 or (depth, rank - 1) in have):
            kept.append((depth, rank, -minus))
            have.add((depth, rank))
    return kept
