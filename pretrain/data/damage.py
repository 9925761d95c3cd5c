"""Damaged train shards: the record a run keeps of them, the share of data.train (of each source of a mixture) they
lost, the warning that names them, and the refusal beyond `data.max_damaged_share`.

Damage is found lazily, by whichever stream reads a shard, on the rank and worker that own that stream, when it
gets there. It never changes the data order: a stream passes over an epoch with nothing readable by a rule of its
own (pretrain.data.stream.examples). This record only decides whether the run may go on. Each DP rank keeps what its
streams found and what the checkpoint it resumed from recorded (every saved rank's part, so a requeue on any layout
starts from all of it); the share is of the whole of data.train, so it only grows as damage is found.
"""
from __future__ import annotations

import logging

from pretrain.core.config import UsageError
from pretrain.core.redact import redact
from pretrain.data.stream import StreamSpec

log = logging.getLogger(__name__)

NAMED = 3  # shards named in a line; the rest are counted


class DamagedShards:
    """{shard index: documents read before the damage} of the shards found damaged, with the rule on their share."""

    def __init__(self, spec: StreamSpec, max_share: float) -> None:
        self.spec, self.max_share = spec, max_share
        self.found: dict[int, int] = {}

    def lost_share(self) -> float:
        """Documents lost over data.train's documents (index.json); without an index, damaged shards over shards."""
        docs = self.spec.expected_docs
        if docs is None:
            return len(self.found) / len(self.spec.shards)
        return sum(docs[i] - min(n, docs[i]) for i, n in self.found.items()) / max(1, sum(docs))

    def add(self, found: dict[int, int]) -> None:
        """Shards a stream found damaged: the new ones are named in a warning with the share lost so far; beyond
        data.max_damaged_share, a UsageError."""
        new = {i: n for i, n in found.items() if i not in self.found}
        if new:
            self.found.update(new)
            self._check()
            log.warning("damaged shards skipped: %s; %s", self._names(new), self._summary())

    def state(self) -> dict[str, int]:
        return {str(i): n for i, n in self.found.items()}

    def load(self, states: list[dict[str, int]]) -> None:
        """The records of every DP rank of a checkpoint (absent in one written before they were kept)."""
        self.found = {int(i): n for state in states for i, n in state.items()}
        if self.found:
            self._check()
            log.warning("the checkpoint records damaged shards: %s; %s", self._names(self.found), self._summary())

    def _check(self) -> None:
        share = self.lost_share()
        if share > self.max_share:
            raise UsageError(f"damaged shards lost {share:.1%} of {self.spec.label}, more than data.max_damaged_share "
                             f"({self.max_share:g}): {self._names(self.found)}; repair them or prepare them again, "
                             "or raise data.max_damaged_share to train on the rest")

    def _summary(self) -> str:
        unit = "documents" if self.spec.expected_docs else "shards"
        return (f"{len(self.found)} of {len(self.spec.shards)} shards, {self.lost_share():.1%} of {self.spec.label}'s "
                f"{unit} lost (data.max_damaged_share {self.max_share:g})")

    def _names(self, found: dict[int, int]) -> str:
        docs = self.spec.expected_docs
        named = [redact(self.spec.shards[i]) + (f" ({n} of {docs[i]} documents read)" if docs else "")
                 for i, n in sorted(found.items())[:NAMED]]
        return ", ".join(named) + (f" and {len(found) - NAMED} more" if len(found) > NAMED else "")
