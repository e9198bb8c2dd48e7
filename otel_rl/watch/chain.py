"""The verdict of a stall as data: a chain of links from the training process down to what is
stuck, what could not be known, and the one sentence that says it (:attr:`Verdict.text`, the
only place the links' words are joined)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Link", "Verdict"]


@dataclass
class Link:
    """One link of the chain: ``process`` is inside ``phase`` and waits on ``waits_on``
    (either may be unknown), for ``seconds``; ``evidence`` says where that came from."""

    process: str
    phase: str | None
    waits_on: str | None
    seconds: float | None
    evidence: str
    #: The link's words in the sentence.
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "phase": self.phase,
            "waits_on": self.waits_on,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "evidence": self.evidence,
        }


@dataclass
class Verdict:
    """The chain from the training process down to what is stuck, and the sentence saying it."""

    chain: list[Link] = field(default_factory=list)
    #: Links that could not be known, each with its reason.
    missing: list[str] = field(default_factory=list)
    #: The job's verdict (:class:`otel_rl.watch.job_verdict.JobVerdict`): the processes that are
    #: not where the rest are, named first.
    job: Any = None

    @property
    def text(self) -> str:
        sentence = " → ".join(link.text for link in self.chain)
        if self.job is not None and self.job.sentence:
            sentence = f"{self.job.sentence}. {sentence[:1].upper()}{sentence[1:]}"
        if self.missing:
            sentence += "; not known: " + "; ".join(self.missing)
        return sentence

    def to_json(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "chain": [link.to_json() for link in self.chain],
            "missing": list(self.missing),
        }
        if self.job is not None:
            out["job"] = self.job.to_json()
        return out
