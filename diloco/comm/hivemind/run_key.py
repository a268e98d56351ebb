"""The run key: only peers that hold it can write the run's DHT records, join its averaging groups
or download a member's state.

A run started with ``comm.run_key`` (or the ``DILOCO_RUN_KEY`` environment variable, which keeps
the key out of config files and shell history) protects three doors:

- DHT records. Every record a worker stores carries an HMAC-SHA256 tag of its key, subkey, value
  and expiration under the run key (``RunKeyValidator``, hivemind's record-validator hook). A
  keyed peer refuses to store a record without a valid tag and ignores such records in what it
  reads, so a peer without the key can neither announce itself for matchmaking nor offer state.
- Averaging groups. hivemind's matchmaking refuses a join request whose schema hash differs from
  the leader's; the schema hash here is an HMAC of the tensors' schema under the run key
  (``keyed_schema_hash``), so it doubles as a membership token that only key holders can present.
- State downloads. A peer serves its state only to a requester that proves it holds the key
  (``state_access.py``, under a key derived from ``derived_key``).

What it does not do: encrypt traffic (libp2p already does, with TLS or Noise). A record's tag can
be replayed unchanged, which only repeats a genuine record.
"""

from __future__ import annotations

import hashlib
import hmac

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

_TAG_BYTES = 32


def derived_key(run_key: str) -> bytes:
    """The secret the run's tags are made under, derived from the run key."""
    return hashlib.sha256(b"diloco-run-key:" + run_key.encode()).digest()


def _tag(key: bytes, record: DHTRecord, value: bytes) -> bytes:
    message = b"\x00".join([record.key, record.subkey, value, repr(float(record.expiration_time)).encode()])
    return hmac.new(key, message, hashlib.sha256).digest()


class RunKeyValidator(RecordValidatorBase):
    """Signs every DHT record with the run key and accepts only records signed with it."""

    def __init__(self, run_key: str):
        if not run_key:
            raise ValueError("RunKeyValidator needs a non-empty run key")
        self._key = derived_key(run_key)

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + _tag(self._key, record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) < _TAG_BYTES:
            return False
        value, tag = record.value[:-_TAG_BYTES], record.value[-_TAG_BYTES:]
        return hmac.compare_digest(tag, _tag(self._key, record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-_TAG_BYTES]

    @property
    def priority(self) -> int:
        return 100  # signs last, so the tag covers what every other validator added

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def keyed_schema_hash(run_key: str, schema_hash: bytes) -> bytes:
    """The averager's schema hash: unchanged for an open run, else an HMAC of it under the key."""
    if not run_key:
        return schema_hash
    return hmac.new(run_key.encode(), b"diloco-schema:" + schema_hash, hashlib.sha256).digest()
