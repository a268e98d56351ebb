"""Fakes of the hivemind transport's collaborators, for the unit tests of its logic: a DHT that
keeps the roster's records in a dict, and the run's helpers as a fixed list."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from diloco.comm.hivemind.helper_record import RunHelpers


def answered(value) -> Future:
    """A DHT request's future, already answered with ``value``."""
    future = Future()
    future.set_result(value)
    return future


class RecordsDHT:
    """The two DHT calls the roster makes, on a dict; records do not expire unless removed."""

    def __init__(self):
        self.records: dict[int, dict] = {}

    def store(self, key, *, subkey, value, expiration_time, return_future):
        self.records[subkey] = value
        return answered(True)

    def get(self, key, latest, return_future):
        if not self.records:
            return answered(None)
        return answered(SimpleNamespace(value={k: SimpleNamespace(value=v) for k, v in self.records.items()}))


class KnownHelpers(RunHelpers):
    """The run's live helpers, as given."""

    def __init__(self, ids: list[str]):
        super().__init__(None, "run")
        self._ids = ids

    def ids(self) -> list[str]:
        return list(self._ids)

    def count(self) -> int:
        return len(self._ids)
