"""Per request: stop speculating while proposals keep being rejected, and try again later.
A proposal that is mostly rejected costs a wider verification step for nothing, so text
the proposer cannot predict (creative answers, for an n-gram lookup) pauses it."""

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpeculationState:
    # (proposed, accepted) of its latest proposals, covering about acceptance_window tokens
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    paused_steps: int = 0  # steps left before it proposes again

    def ready(self) -> bool:
        """Whether it may propose this step."""
        return not self.paused_steps

    def tick(self) -> None:
        """One step of its pause has passed (called on every step the request runs)."""
        if self.paused_steps:
            self.paused_steps -= 1

    def record(self, proposed: int, accepted: int, window: int, min_rate: float, backoff: int) -> None:
        self.recent.append((proposed, accepted))
        total = sum(p for p, _ in self.recent)
        while total - self.recent[0][0] >= window:
            total -= self.recent.popleft()[0]
        if total >= window and sum(a for _, a in self.recent) < min_rate * total:
            self.paused_steps = backoff
            self.recent.clear()
