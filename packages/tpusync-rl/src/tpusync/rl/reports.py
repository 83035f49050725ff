"""What one version's sync came to: :class:`PublishReport` on a trainer rank (on rank 0 with
every sampler's outcome), :class:`UpdateResult` on a sampler rank; :func:`listed` shortens the
lists of names that refusals quote."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PublishReport", "UpdateResult", "listed"]


def listed(items: list[str]) -> str:
    """The first four of ``items``, ``"; "``-joined, then how many more (for messages that name
    many tensors or modules)."""
    return "; ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


@dataclass
class PublishReport:
    """What happened to one version: ``failed`` maps ``"replica:rank"`` to a reason."""

    version: int
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # Block bytes the trainer served: sent to its direct tree children (adopted orphans
    # included), plus read by each shared-segment reader.
    bytes_sent: int = 0
    # RE-PARENTING CONTRACT (rank 0): orphan "replica:rank" -> the failed parent it was moved
    # away from; the orphan got the rest of the version from the trainer.
    reparented: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class UpdateResult:
    version: int
    ok: bool
    reason: str | None = None
    seconds: float = 0.0
    bytes: int = 0
    forwarded_to: int = 0
    # How the bytes came: "shared-segment" (read from the trainer's /dev/shm pool), "unix" (P/D
    # same-host copy into this sampler's pool) or "tcp"; "" when nothing was pulled.
    path: str = ""
