"""Speculative decoding: propose -> one verifier forward over [last, *draft] -> judge -> trim.

The output follows the verifier's distribution exactly, whatever the drafter (see quasar.decoding.rejection); with
greedy sampling it is the verifier's greedy output token for token, and so is a sampled deterministic draft's
(n-gram, suffix, every tree: matched against plain decoding's draws) with the same generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

import torch

from quasar.decoding.drafters.base import Draft, Drafter
from quasar.decoding.drafters.forced import forced_draft
from quasar.decoding.grammar import GrammarMask
from quasar.decoding.autoregressive import Steps, StopRule
from quasar.decoding.confidence_guard import ConfidenceGuard
from quasar.decoding.costs import StepCosts
from quasar.model.kv_cache import KVCache
from quasar.decoding.step import Step
from quasar.model.llama import Transformer
from quasar.decoding.processors import Processing, grammar_of
from quasar.decoding.sampling import Sampler, SamplingParams, TargetRows
from quasar.decoding.stats import GenerationStats
from quasar.spec import AUTO, MAX_DRAFT
from quasar.decoding.rejection import Verdict, greedy_verdict, matched_verdict, rejection_sample
from quasar.decoding.tree import DraftTree, greedy_tree_verdict, sample_tree_verdict
from quasar.decoding.tree_budget import TreeBudget



# yields the Step that verifies a draft, gets its logits; returns (the draft as scored, the verdict, target rows)
VerifyStep = Generator[Step, torch.Tensor, tuple[Draft, Verdict, TargetRows | None]]


class DraftLength:
    """How many tokens to draft. Fixed k, or adaptive ('auto'): the k that promises the most tokens per second of
    a verify step, (1 + the summed chances of its k draft tokens) / cost(k + 1 rows), from the acceptance seen at
    each draft position (`chances`) and what steps of each size cost on this machine (`costs`, fitted on the
    decoder's recent verify steps); one more than that after a draft accepted whole (longer runs get their chance).
    On a CPU whose extra rows are dear (AVX2 without VNNI: six rows cost about three one-row steps) and a text the
    drafts miss, that is 0: the step is a plain one. With k_min 0 (a free drafter, greedy or matched) such a step
    still asks the drafter for one token and counts whether the verifier chose it (`guessed`), so drafting resumes
    where it pays again."""

    K_MAX, K_START = MAX_DRAFT, 4  # k + 1 rows per verify step
    DECAY, PRIOR_HITS, PRIOR_TRIES = 0.9, 1.0, 4.0  # the acceptance counts behind `chances`

    def __init__(self, k: int | str, costs: StepCosts | None = None, k_min: int = 1) -> None:
        """costs None: the prior costs, never measured (where the drafts decide which random numbers a seeded
        request draws, its draft lengths must not depend on how fast the machine ran)."""
        self.adaptive = k == AUTO
        self.k = self.K_START if self.adaptive else int(k)
        self.k_min = k_min
        self.costs = costs
        # per draft position: tokens accepted / judged there (a position is judged once the ones before it
        # were accepted), recent steps weighing more, from a cautious prior (1 in 4): a batch spends rows on the
        # drafts most likely to be accepted, and a few lucky steps must not make a draft look certain
        self.hits, self.tries = [self.PRIOR_HITS] * self.K_MAX, [self.PRIOR_TRIES] * self.K_MAX

    def chances(self, n: int, forced: tuple[int, ...] = ()) -> tuple[float, ...]:
        """The chance that each of n draft tokens is accepted: the product of the acceptance rates of the
        positions up to it (n-gram drafts tend to be all right or wrong early, so later positions that are
        reached are accepted more often than the first); a token a grammar forced (at a position in `forced`) is
        taken as certain."""
        out, chance = [], 1.0
        for i, (hits, tries) in enumerate(zip(self.hits[:n], self.tries[:n])):
            chance *= 1.0 if i in forced else hits / tries
            out.append(chance)
        return tuple(out)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.count(proposed, accepted)
        if self.adaptive:
            self.k = min(self.K_MAX, max(self.best(), proposed + 1 if accepted == proposed else 0))

    def guessed(self, right: bool) -> None:
        """A plain step's outcome for the drafter's one-token guess: the first position's acceptance, as a draft of
        it would have been judged (a greedy or matched verdict accepts exactly the token the verifier picks or draws)."""
        self.count(1, int(right))
        if self.adaptive:
            self.k = self.best()

    def count(self, proposed: int, accepted: int) -> None:
        for position in range(min(accepted + 1, proposed)):  # the judged positions
            self.hits[position] = self.DECAY * self.hits[position] + (position < accepted)
            self.tries[position] = self.DECAY * self.tries[position] + 1

    def timed(self, rows: int, seconds: float) -> None:
        """A forward of `rows` rows in all (this step's and, in a batch, the others') took `seconds`: the costs are
        those of forwards by their size, not of this request's share of a busy batch."""
        if self.costs is not None:
            self.costs.add(rows, seconds)

    def best(self) -> int:
        """The draft length (k_min to K_MAX) that promises the most tokens per second."""
        def cost(rows: int) -> float:
            seconds = self.costs.cost(rows) if self.costs is not None else None
            return 1.0 + StepCosts.PRIOR * rows if seconds is None or seconds <= 0 else seconds

        best, rate, expected = 0, 1.0 / cost(1), 1.0
        for k, chance in enumerate(self.chances(self.K_MAX), 1):
            expected += chance
            if expected / cost(k + 1) > rate:
                best, rate = k, expected / cost(k + 1)
        return max(self.k_min, best)


def judge(draft: Draft, logits: torch.Tensor, params: SamplingParams, sampler: Sampler,
          generator: torch.Generator) -> tuple[Verdict, TargetRows | None]:
    """The verdict on a draft from the verifier's rows over [last, *draft] ([k + 1, V]), after the request's
    processors (the sampler's): the argmax rule when greedy, else the draws of plain decoding matched against a
    deterministic draft, or rejection sampling against a drafter's distributions, on rows computed as they are
    reached (returned, for a cascade to pass on)."""
    logits = sampler.processed(logits, draft.tokens)
    if params.greedy:
        return greedy_verdict(draft.tokens, sampler.argmax(logits).tolist()), None
    target = sampler.rows(logits)
    if draft.probs is None:
        return matched_verdict(draft.tokens, target, generator), target
    return rejection_sample(draft.tokens, draft.probs, target, generator), target


def verify_step(propose: Callable[[int], Draft], k: int, feed: list[int], cache: KVCache, params: SamplingParams,
                sampler: Sampler, generator: torch.Generator, length: DraftLength, stats: GenerationStats,
                cut: bool = False, guard: ConfidenceGuard | None = None) -> VerifyStep:
    """One speculative step, the engine's verifier's and a cascade's middle level's alike: up to k draft tokens
    (propose(k)) after `feed` (the tokens `cache` has not seen, the draft continuing the last), the Step that
    scores them yielded, the draft judged on the logits sent back (a full batch may score a prefix of it; `cut`
    allows that), the guard's review, the time and the acceptance counted. Returns the draft as scored, the
    verdict and, when sampling, the verifier's rows (for a cascade to pass on)."""
    start = time.perf_counter()
    draft = propose(k)
    verifying = time.perf_counter()
    logits = yield Step([*feed, *draft.tokens], cache, cut=cut, chances=length.chances(len(draft), draft.forced),
                        timed=length.timed)
    logits = logits[len(feed) - 1 :]  # [scored, V] over [last, *draft]
    if len(logits) <= len(draft):
        draft = replace(draft, tokens=draft.tokens[: len(logits) - 1])  # a busy batch scored a prefix
    verdict, target = judge(draft, logits, params, sampler, generator)
    if guard is not None:
        verdict = guard.review(cache, [feed[-1], *draft.tokens], logits, verdict, sampler, stats)
    stats.draft_s += verifying - start
    stats.verify_s += time.perf_counter() - verifying
    length.update(len(draft), verdict.accepted)
    return draft, verdict, target


def verify_tree(tree: DraftTree, last: int, cache: KVCache, params: SamplingParams, sampler: Sampler,
                budget: TreeBudget, stats: GenerationStats, cut: bool = False) -> VerifyStep:
    """verify_step for a draft tree (quasar.decoding.tree): its nodes scored in one forward after `last`, each row
    attending to its own ancestors, walked by matching each row's draw (its argmax when greedy); the accepted path's
    keys and values moved into place (KVCache.keep). Returns the draft as scored (the accepted path first, then the
    other nodes), the verdict on it and, when sampling, the verifier's rows."""
    verifying = time.perf_counter()
    base = cache.length + 1  # the first node's slot
    logits = yield Step([last, *tree.tokens], cache, cut=cut, chances=tuple(tree.chances), timed=budget.timed,
                        tree=() if tree.is_chain() else tree.rows())
    tree = tree.prefix(len(logits) - 1)  # logits [n + 1, V] over [last, *nodes]: a busy batch scored a prefix
    target = None if params.greedy else sampler.rows(logits)
    if target is None:
        verdict = greedy_tree_verdict(tree, sampler.argmax(logits).tolist())
    else:
        verdict = sample_tree_verdict(tree, target, sampler.generator)
    if not tree.is_chain():
        cache.keep(base, [base + node for node in verdict.path])
    stats.verify_s += time.perf_counter() - verifying
    budget.count(tree, verdict)
    others = [token for node, token in enumerate(tree.tokens) if node not in verdict.path]
    return (Draft([tree.tokens[node] for node in verdict.path] + others), Verdict(verdict.accepted, verdict.token),
            target)


@dataclass
class Speculative:
    """A Decoder (see quasar.decoding.engine) that drafts with `drafter` and verifies with the engine's model; with
    `width` > 1 ('auto': the budget decides) a drafter that proposes trees drafts several candidates a position."""

    drafter: Drafter
    k: int | str = AUTO
    guard: ConfidenceGuard | None = None  # re-scores positions the verifier is unsure of with the float model (approximate)
    forced_drafts: bool = True  # with a grammar: draft its forced tokens first (quasar.decoding.drafters.forced)
    width: int | str = 1  # candidates per position of a draft tree (quasar.decoding.tree_budget); 1: one chain

    def __post_init__(self) -> None:
        self.idle: list[Drafter] = [self.drafter]  # drafters not serving a request now
        self.costs = StepCosts()  # what verify steps of each size cost: every request's draft length reads it

    def __call__(
        self,
        model: Transformer,
        cache: KVCache,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: StopRule,
        stats: GenerationStats,
        processing: Processing | None = None,
    ) -> Steps:
        drafter = self.idle.pop() if self.idle else self.drafter.spawn()  # one drafter per request in flight
        try:
            yield from self.decode(model, drafter, cache, prompt_ids, params, stop, stats, processing)
        finally:
            self.idle.append(drafter)

    def decode(self, model: Transformer, drafter: Drafter, cache: KVCache, prompt_ids: list[int],
               params: SamplingParams, stop: StopRule, stats: GenerationStats,
               processing: Processing | None = None) -> Steps:
        sampler = Sampler(params, model.plan, processing)
        # The output does not depend on the drafts when greedy, and when sampling a free drafter's deterministic
        # drafts, matched against plain decoding's draws (quasar.decoding.rejection; a guard's re-scores follow the
        # draft). Otherwise a seeded request draws the same random numbers alone or in any batch only if its draft
        # lengths follow its own tokens alone: it weighs rows by the prior costs, not by timings.
        trees = self.trees(model, drafter, cache, processing)  # a tree's nodes are deterministic, whatever drafts them
        independent = params.greedy or trees or (drafter.free and self.guard is None)
        costs = None if not independent and params.seed is not None else self.costs
        guessing = drafter.free and independent  # may stop drafting and still watch its guesses
        length = DraftLength(self.k, costs, k_min=0 if guessing else 1)
        # a free drafter's tree may shrink to nothing at any temperature (trees are independent): a plain step's row
        # still says how likely its candidates were
        budget = TreeBudget(self.width, self.k, costs, k_min=0 if guessing else 1) if trees else None
        grammar = grammar_of(processing)
        # A batch may score fewer draft tokens than proposed when it is full, unless that could change the
        # output: a seeded request whose drafts draw random numbers gives the same tokens as alone only with the
        # same drafts.
        may_cut = independent or params.seed is None
        start = time.perf_counter()
        drafter.reset()
        stats.middle = getattr(drafter, "stats", None)  # a cascade's middle level counts its own steps
        drafter.commit(prompt_ids)
        logits = yield Step(prompt_ids[cache.length :], cache, last_only=True)  # a kept start is not run again
        pending = [sampler.next_token(logits[-1])]
        stats.prefill_s = time.perf_counter() - start
        tokens, reason = stop.cut(pending)
        while True:
            yield tokens
            if reason:
                stats.finish_reason = reason
                return
            drafter.commit(pending)
            room = min(MAX_DRAFT, cache.max_len - cache.length - 1, stop.budget - stop.emitted - 1)
            before = cache.length
            if budget is not None:
                draft, verdict = yield from self.tree_step(drafter, budget, room, pending[-1], cache, params, sampler,
                                                           stats, may_cut)
            else:
                draft, verdict = yield from self.chain_step(drafter, length, grammar, room, pending[-1], cache, params,
                                                            sampler, stats, may_cut, guessing)
            cache.trim(cache.length - (before + verdict.accepted + 1))  # keep [last, *accepted]
            pending = draft.tokens[: verdict.accepted] + [verdict.token]
            tokens, reason = stop.cut(pending)
            accepted = min(verdict.accepted, len(tokens))
            stats.record_step(proposed=len(draft), accepted=accepted, emitted=len(tokens),
                              forced=sum(i < accepted for i in draft.forced))

    def chain_step(self, drafter: Drafter, length: DraftLength, grammar: GrammarMask | None, room: int, last: int,
                   cache: KVCache, params: SamplingParams, sampler: Sampler, stats: GenerationStats, cut: bool,
                   guessing: bool) -> Generator[Step, torch.Tensor, tuple[Draft, Verdict]]:
        """One step of a chain-drafting request: up to length.k draft tokens verified (none: a plain step, whose
        token still tells the length how the drafter's one-token guess fares)."""
        k = min(length.k, room)
        guess = drafter.propose(1, params, sampler.generator) if k == 0 and guessing and room > 0 else None
        draft, verdict, _ = yield from verify_step(
            self.proposer(drafter, grammar, room, params, sampler.generator), k, [last], cache, params,
            sampler, sampler.generator, length, stats, cut=cut, guard=self.guard)
        if guess is not None and guess.tokens and not draft.tokens:
            length.guessed(guess.tokens[0] == verdict.token)
        return draft, verdict

    def trees(self, model: Transformer, drafter: Drafter, cache: KVCache, processing: Processing | None) -> bool:
        """Whether this request drafts trees: width > 1 (or 'auto'), a drafter that proposes them, rows that may be a
        tree (the fused kernels' float32 attention, a cache without rings), no row processors (they read each row's
        draft prefix) and no guard (it re-scores a chain)."""
        return (self.width != 1 and hasattr(drafter, "propose_tree") and model.plan.tree_rows and not cache.ring
                and processing is None and self.guard is None)

    def tree_step(self, drafter: Drafter, budget: TreeBudget, room: int, last: int, cache: KVCache,
                  params: SamplingParams, sampler: Sampler, stats: GenerationStats,
                  cut: bool) -> Generator[Step, torch.Tensor, tuple[Draft, Verdict]]:
        """One step of a tree-drafting request: the drafter's tree best first, cut to what pays, verified. A tree
        of no nodes makes a plain step, whose row still tells the budget how likely the drafter's first candidates
        were (each one's target probability: how often it would have been the one accepted)."""
        start = time.perf_counter()
        chance = lambda depth, rank: budget.chance(depth, rank) if depth <= room else 0.0  # noqa: E731 (none deeper)
        whole = drafter.propose_tree(budget.nodes(cache.max_len - cache.length), budget.width, chance)
        tree = budget.cut(whole)
        stats.draft_s += time.perf_counter() - start
        draft, verdict, target = yield from verify_tree(tree, last, cache, params, sampler, budget, stats, cut)
        if not draft.tokens and whole.tokens:  # a plain step (by the budget's cut or a busy batch's)
            candidates = [whole.tokens[c] for c in whole.children(-1)]
            budget.observed(candidates, [float(t == verdict.token) if target is None else target.prob(0, t)
                                         for t in candidates])
        return draft, verdict

    def proposer(self, drafter: Drafter, grammar: GrammarMask | None, room: int, params: SamplingParams,
                 generator: torch.Generator) -> Callable[[int], Draft]:
        """propose(k): the drafter's k tokens, or with a grammar (and `forced_drafts`) its forced tokens first, up
        to `room` (quasar.decoding.drafters.forced)."""
        if grammar is None or not self.forced_drafts:
            return lambda k: drafter.propose(k, params, generator)
        return lambda k: forced_draft(grammar, drafter, k, room, params, generator)
