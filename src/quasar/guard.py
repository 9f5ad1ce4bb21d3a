"""Confidence-guarded precision ('--guard MARGIN', issue 17): the W8A8 verifier decides, except where it is
unsure. A position whose W8A8 top-1 logit leads the runner-up by less than MARGIN is re-scored by the float
model (bf16) before it is accepted: the float model's token is emitted there and the step ends.

Approximate by design: a position where W8A8 is confident but wrong stays wrong. With MARGIN = 0 the output is
`ngram+w8a8`'s; with an infinite MARGIN every position is re-scored and the output is the float model's (at
float cost). The float model's KV cache follows the emitted stream lazily (kv_cache.StreamCache), so it only
runs where a position is re-scored, over the tokens emitted since its last run.
"""

from __future__ import annotations

import torch

from quasar.kv_cache import StreamCache
from quasar.models.llama import FIXED_ROWS, Transformer
from quasar.sampling import Sampler
from quasar.stats import GenerationStats
from quasar.verify import Verdict


class Guard:
    def __init__(self, model: Transformer, margin: float) -> None:
        if not margin >= 0:
            raise ValueError(f"the guard margin must be a number >= 0 (logits), got {margin}")
        self.model = model  # the float model
        self.margin = margin
        self.stream = StreamCache(model)

    @torch.inference_mode()
    def review(self, stream: list[int], draft: list[int], logits: torch.Tensor, verdict: Verdict,
               sampler: Sampler, stats: GenerationStats) -> Verdict:
        """stream: the tokens before this step's first scored position; logits [k + 1, V] of W8A8's verify step;
        the verdict W8A8 reached. Returns it, or a shorter one ending in the float model's token at the first
        unsure position among those the verdict emits."""
        emitted = [*draft[: verdict.accepted], verdict.token]
        top2 = logits[: len(emitted)].float().topk(2, dim=-1).values  # [a + 1, 2]
        unsure = ((top2[:, 0] - top2[:, 1]) < self.margin).nonzero()
        if len(unsure) == 0:
            return verdict
        j = int(unsure[0])
        token = self.float_token(stream + emitted[:j], sampler)
        stats.rechecked_tokens += 1
        stats.recheck_changed += token != emitted[j]
        return Verdict(j, token)

    def float_token(self, context: list[int], sampler: Sampler) -> int:
        """The float model's next token after `context` (greedy, or sampled with the request's sampler)."""
        cache = self.stream.ready(len(context) + FIXED_ROWS)
        feed = self.stream.follow(context, most=FIXED_ROWS)  # the stretch emitted since the last re-score
        logits = self.model(torch.tensor([feed], device=self.model.device), cache, last_only=True)[0, -1]  # [V]
        self.stream.fed(feed)
        return sampler.next_token(logits)

