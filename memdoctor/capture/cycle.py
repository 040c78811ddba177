"""Which optimizers make one training step: the session's step boundaries, learned from the order in
which optimizers step.

One optimizer is the common case, and then every optimizer step ends a training step. A GAN steps its
discriminator's and then its generator's, with a forward between them, and a training step ends only
after both; a WGAN's critic steps several times between two generator steps. ``OptimizerCycle`` learns
the set from the steps it sees, without the user's help.
"""

from __future__ import annotations

# An optimizer of the training step that has not stepped for this many optimizer steps is no longer one
# (see OptimizerCycle.note); well above a WGAN's 5-10 critic steps per generator step.
STALE_AFTER = 32


class OptimizerCycle:
    """The optimizers of one training step (``members``, None until known) and which of them stepped
    in the step in progress."""

    def __init__(self) -> None:
        self.members: frozenset[int] | None = None
        self.since: list[int] = []  # optimizers stepped since the cycle was last seen to start
        self.last: int | None = None  # the optimizer that steps last in a training step
        self.count = 0  # optimizer steps so far, and the count at each optimizer's first and last step
        self.last_step_at: dict[int, int] = {}
        self.first_step_at: dict[int, int] = {}
        self.stepped: set[int] = set()  # optimizers stepped in the step in progress

    def new_step(self) -> None:
        self.stepped = set()

    def note(self, key: int) -> None:
        """Learn which optimizers make one training step: those that step between two steps of the
        same optimizer.

        The set only grows (a WGAN's critic steps several times between two generator steps: the
        critic alone repeating says nothing about the generator), except that an optimizer leaves it
        when it has not stepped since one of those now stepping first did (a script that moved on to
        another optimizer), or for ``STALE_AFTER`` optimizer steps, so that steps close again."""
        self.count += 1
        self.first_step_at.setdefault(key, self.count)
        if key in self.since:
            seen = frozenset(self.since)
            if self.members is None or seen >= self.members or self._stale(self.members - seen, seen):
                self.members, self.last = seen, self.since[-1]
            self.since = []
        self.since.append(key)
        self.stepped.add(key)
        self.last_step_at[key] = self.count

    def _stale(self, missing: frozenset[int], seen: frozenset[int]) -> bool:
        newest = max(self.first_step_at[k] for k in seen)
        return any(
            self.last_step_at[k] < newest or self.count - self.last_step_at[k] > STALE_AFTER for k in missing
        )

    def done(self, last: int | None = None) -> bool:
        """Whether every optimizer of a training step has stepped in the step in progress; with
        ``last`` (the optimizer that just stepped), also whether it is the one that ends the cycle: on
        a timing step the step ends at an optimizer step, and must end after the cycle's last one."""
        if self.members is None:
            return True
        return self.members <= self.stepped and (last is None or last == self.last)
