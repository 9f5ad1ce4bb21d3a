"""How large a draft tree to verify: the acceptance seen at each depth and sibling rank, and what steps of each
size cost on this machine.

A node is worth its chance of being accepted, P(node) = P(parent) * a(depth, rank), where a(d, r) is how often the
candidate of rank r (0: the drafter's first) among a node's children at depth d was the one accepted when its parent
was reached (recent steps weighing more, from cautious priors). The drafter builds its tree best first by those
chances (quasar.decoding.tree), so any prefix of its nodes is a tree; the budget keeps the prefix of n nodes that
promises the most tokens per second, (1 + sum of their chances) / cost(n + 1 rows): a tree is never wider or deeper
than it pays for, and with no node worth its row the step is a plain one (SpecInfer's token tree, Miao et al. 2024;
Sequoia's cost-aware tree size, Chen et al. 2024).
"""

from __future__ import annotations

import heapq

from quasar.decoding.costs import StepCosts
from quasar.decoding.tree import MAX_TREE, DraftTree, TreeVerdict
from quasar.spec import AUTO, MAX_DRAFT, MAX_WIDTH


class TreeBudget:
    """The tree a request drafts each step: at most `width` candidates a position ('auto': MAX_WIDTH, the cost cut
    deciding), at most k deep ('auto': MAX_DRAFT, the cost cut deciding), the nodes kept chosen by cost."""

    DECAY = 0.9
    START_DEPTH = 4
    PRIOR_TRIES = 4.0
    # by rank, of PRIOR_TRIES: a first candidate 1 in 4, later ones rarer; past the first position twice that (a
    # copied text that was right so far tends to stay right)
    PRIOR_HITS = (1.0, 0.4, 0.2, 0.1)

    def __init__(self, width: int | str, k: int | str, costs: StepCosts | None, k_min: int = 1) -> None:
        """costs None: the prior costs, never measured (where the drafts decide which random numbers a seeded
        request draws, they must not depend on how fast the machine ran)."""
        self.width = MAX_WIDTH if width == AUTO else int(width)
        self.depth = MAX_DRAFT if k == AUTO else int(k)
        self.adaptive = k == AUTO
        self.costs, self.k_min = costs, k_min
        prior = [self.PRIOR_HITS[min(r, len(self.PRIOR_HITS) - 1)] for r in range(self.width)]
        self.hits = [[h * (1 if d == 0 else 2) for h in prior] for d in range(MAX_DRAFT)]  # [depth - 1][rank]
        self.tries = [[self.PRIOR_TRIES] * self.width for _ in range(MAX_DRAFT)]
        # the depth the next tree reaches whatever the cut: one past a branch accepted whole (longer runs get their
        # chance, as DraftLength grows k), and DraftLength's starting length at first
        self.reach = self.START_DEPTH

    def chance(self, depth: int, rank: int) -> float:
        """a(depth, rank): the chance that a node's candidate of this rank is accepted once the node is reached."""
        if depth > self.depth or rank >= self.width:
            return 0.0
        return self.hits[depth - 1][rank] / self.tries[depth - 1][rank]

    def nodes(self, room: int) -> int:
        """How many nodes to ask the drafter for (a step scores them and one more row, within `room` rows): with
        k 'auto', no more than the cut would keep of the ideal tree (every node with `width` candidates, each at
        its chance; a real tree's nodes are some of those, so it keeps no more), and at least the first position's
        candidates (a plain step's row still judges them)."""
        most = max(0, min(MAX_TREE, room - 1))
        if not self.adaptive:
            return most
        return min(most, max(self.keep(*self.ideal(most)), self.width))

    def ideal(self, n: int) -> tuple[list[float], list[int]]:
        """The chances and depths of the best n nodes of the ideal tree, best first (as the drafters grow theirs)."""
        offers = [(-self.chance(1, 0), 1, 0, 1.0)]  # (-P, depth, rank, P(parent))
        chances, depths = [], []
        while offers and len(chances) < n:
            minus, depth, rank, parent = heapq.heappop(offers)
            if minus >= 0:
                break
            chances.append(-minus)
            depths.append(depth)
            for d, r, reach in ((depth, rank + 1, parent), (depth + 1, 0, -minus)):
                heapq.heappush(offers, (-reach * self.chance(d, r), d, r, reach))
        return chances, depths

    def cut(self, tree: DraftTree) -> DraftTree:
        """The prefix of the tree (its nodes best first) that promises the most tokens per second, or that reaches
        `reach` deep if that is longer; all of it, up to depth k, where k is fixed."""
        if not self.adaptive:
            return tree
        return tree.prefix(max(min(self.k_min, len(tree)), self.keep(tree.chances, tree.depths())))

    def keep(self, chances: list[float], depths: list[int]) -> int:
        """How many of these nodes (best first) to verify: the most tokens per second, or `reach` deep."""
        best, rate, expected = 0, 1.0 / self.cost(1), 1.0
        for n, chance in enumerate(chances, 1):
            expected += chance
            if expected / self.cost(n + 1) > rate:
                best, rate = n, expected / self.cost(n + 1)
        reach = min(self.reach, max(depths, default=0))
        reaching = next((n for n, depth in enumerate(depths, 1) if depth >= reach), 0) if reach else 0
        return max(best, reaching)

    def cost(self, rows: int) -> float:
        seconds = self.costs.cost(rows) if self.costs is not None else None
        return 1.0 + StepCosts.PRIOR * rows if seconds is None or seconds <= 0 else seconds

    def timed(self, rows: int, seconds: float) -> None:
        """A forward of `rows` rows in all (a batch's too) took `seconds`."""
        if self.costs is not None:
            self.costs.add(rows, seconds)

    def count(self, tree: DraftTree, verdict: TreeVerdict) -> None:
        """Each node the walk reached (the root, then the accepted path): for each of its children, whether it was
        the one accepted."""
        whole = bool(verdict.path) and not tree.children(verdict.path[-1])
        self.reach = min(self.depth, verdict.accepted + 1) if whole else 0
        reached = [-1, *verdict.path]
        for depth, node in enumerate(reached, 1):
            if depth > MAX_DRAFT:
                break
            taken = verdict.path[depth - 1] if depth <= len(verdict.path) else None
            for rank, child in enumerate(tree.children(node)[: self.width]):
                self.seen(depth, rank, child == taken)

    def observed(self, candidates: list[int], accepted: list[float]) -> None:
        """A plain step's outcome for the drafter's first-position candidates: how likely each was to be the one
        accepted (greedy: 1 for the verifier's token, else 0; sampling: its target probability, the chance that
        sampling without replacement accepts it), so that drafting resumes where it pays again."""
        for rank, chance in enumerate(accepted[: self.width]):
            self.seen(1, rank, chance)

    def seen(self, depth: int, rank: int, accepted: float) -> None:
        self.hits[depth - 1][rank] = self.DECAY * self.hits[depth - 1][rank] + accepted
        self.tries[depth - 1][rank] = self.DECAY * self.tries[depth - 1][rank] + 1
