"""Every part of hivemind's insides that diloco depends on, as hivemind 1.1.12 has it.

diloco subclasses hivemind's averager, its all-reduce runner, its reducer, its DHT and a record
validator, and replaces some of their methods, private ones among them (``OVERRIDDEN``); it calls
other private methods of hivemind's, or counts on what they do around the methods it replaced
(``RELIED_ON``); and it reads and sets attributes of hivemind's objects (``ATTRIBUTES``). None of it
is hivemind's public promise: the package pins ``hivemind==1.1.12``. Each method is recorded with
its signature and a fingerprint of its source (its code without docstring or comments), and
``tests/unit/comm/hivemind/test_overrides.py`` fails naming every method whose installed
signature or code differs, and every attribute hivemind no longer sets. Moving to another
hivemind is then a checked step: read what changed in each method named, adapt the override (or
confirm it still holds), and record the new versions (``python -m diloco.comm.hivemind.overrides``
prints the table as the installed hivemind has it).

At run time an averager whose hivemind is not the pinned version says so once in its log
(``warn_if_not_pinned``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import itertools
import logging
import textwrap
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PINNED = "1.1.12"

_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
_RUNNER = "hivemind.averaging.allreduce.AllReduceRunner"
_CONTAINER = "hivemind.averaging.partition.TensorPartContainer"
_REDUCER = "hivemind.averaging.partition.TensorPartReducer"
_DHT = "hivemind.dht.dht.DHT"
_VALIDATOR = "hivemind.dht.validation.RecordValidatorBase"
_OURS = "diloco.comm.hivemind."


@dataclass(frozen=True)
class Pinned:
    """A method of hivemind's (``owner``: its class, dotted; ``name``), its ``signature`` and
    ``fingerprint`` in the pinned version, and ``ours``: our class that overrides it, or for a
    method we rely on, where we do (dotted, from ``diloco.comm.hivemind`` unless it starts with
    ``diloco.``)."""

    owner: str
    name: str
    signature: str
    fingerprint: str
    ours: str

    @property
    def where(self) -> str:
        return f"{self.owner}.{self.name}"

    @property
    def ours_path(self) -> str:
        return self.ours if self.ours.startswith("diloco.") else _OURS + self.ours


def _of(owner: str, ours: str, *methods: tuple[str, str, str]) -> tuple[Pinned, ...]:
    """Entries of one of hivemind's classes, for one of ours: (name, signature, fingerprint) each."""
    return tuple(Pinned(owner, name, signature, digest, ours) for name, signature, digest in methods)


# hivemind's methods our classes replace: every one (test_overrides.py finds them in our classes)
OVERRIDDEN = (
    *_of(
        _AVERAGER,
        "averager.ExactAverager",
        (
            "__init__",
            "(self, averaged_tensors, dht, *, start, prefix, target_group_size=None, min_group_size=2, "
            "initial_group_bits='', min_matchmaking_time=5.0, request_timeout=3.0, averaging_alpha=1.0, "
            "part_size_bytes=524288, allreduce_timeout=None, next_chunk_timeout=None, sender_timeout=None, "
            "reducer_timeout=None, compression=<NoCompression>, state_compression=<NoCompression>, "
            "tensor_infos=None, bandwidth=None, min_vector_size=0, auxiliary=False, allow_state_sharing=None,"
            " declare_state_period=30, client_mode=None, daemon=True, shutdown_timeout=5)",
            "c46e673120aa8662",
        ),
        ("run_in_background", "(self, await_ready=True, timeout=None)", "bc7f66c203af9f25"),
        ("run", "(self)", "6515645b7b92f549"),
        ("rpc_aggregate_part", "(self, stream, context)", "986079a1a5f20a85"),
        ("_run_allreduce_inplace_", "(self, tensors, group_info, group_id=None, **kwargs)", "03f4f7360053b1ba"),
    ),
    *_of(
        _AVERAGER,
        "state_serving.StateServing",
        ("get_current_state", "(self)", "3afe5c34c578e2e4"),
        ("rpc_download_state", "(self, _request, _context)", "7bd6ee09c512d64b"),
    ),
    *_of(
        _AVERAGER,
        "state_download.StateDownload",
        ("load_state_from_peers", "(self, wait=True, timeout=None)", "f65f31543e84feae"),
        ("_load_state_from_peers", "(self, future, timeout=None)", "55a0f4231a90dee8"),
    ),
    *_of(
        _RUNNER,
        "exact_allreduce.ExactAllReduceRunner",
        (
            "__init__",
            "(self, *, p2p, servicer_type, prefix, group_id, tensors, weight=None, ordered_peer_ids, "
            "peer_fractions, modes=None, sender_timeout=None, reducer_timeout=None, **kwargs)",
            "c8cc59ed2dba74ac",
        ),
        ("run", "(self)", "fdb8ee69e59a2daf"),
        ("_generate_input_for_peer", "(self, peer_index)", "2225b98fee8b9864"),
        ("_communicate_with_peer", "(self, peer_id)", "a22a918e2872a711"),
    ),
    *_of(
        _RUNNER,
        "exact_reducing.ShareReducing",
        ("rpc_aggregate_part", "(self, stream, context)", "751fa7345916824e"),
        ("_accumulate_parts_streaming", "(self, stream, sender_index)", "111284a4802d95de"),
    ),
    *_of(
        _REDUCER,
        "reducer.SenderlessEndingReducer",
        ("__init__", "(self, part_shapes, num_senders)", "5eaf5f3dc1003f73"),
        ("check_current_part_finished", "(self)", "fdaa2444e431295c"),
        ("on_sender_failed", "(self, sender_index)", "f31dd0ba20f84b83"),
    ),
    *_of(
        _REDUCER,
        "reducer.ScreeningReducer",
        ("accumulate_part", "(self, sender_index, part_index, tensor_part, weight=1.0)", "d04f8add0ade5d36"),
    ),
    *_of(
        _DHT,
        "owned_dht.OwnedDHT",
        (
            "__init__",
            "(self, initial_peers=None, *, start, p2p=None, daemon=True, num_workers=4, "
            "record_validators=<tuple>, shutdown_timeout=3, await_ready=True, **kwargs)",
            "4eb1e78ba0db24ce",
        ),
        ("run_in_background", "(self, await_ready=True, timeout=None)", "8c529c8f30d168f7"),
        ("run", "(self)", "b519da0235f98666"),
    ),
    *_of(
        _VALIDATOR,
        "run_key.RunKeyValidator",
        ("sign_value", "(self, record)", "442efd063ab2e30a"),
        ("validate", "(self, record)", "284383b42400ce17"),
        ("strip_value", "(self, record)", "586142d76644de52"),
        ("priority", "(self)", "e3344d317ae7cdbf"),
        ("merge_with", "(self, other)", "fc3cd6c3a49f1d38"),
    ),
)

# hivemind's methods we call (private ones), or whose code around our overrides ours counts on
RELIED_ON = (
    *_of(
        _AVERAGER,
        "averager.ExactAverager",
        ("_aggregate_with_group", "(self, group_info, min_vector_size, **kwargs)", "0e4f2e484130a972"),
        ("_run_internal", "(self)", "702c0c2e2156cdea"),
    ),
    *_of(
        _RUNNER,
        "averager.ExactAverager",
        ("__aiter__", "(self)", "afdc14c0fb32301d"),
    ),
    *_of(
        _RUNNER,
        "exact_allreduce.ExactAllReduceRunner",
        ("_ban_sender", "(self, peer_id)", "1b9de5889bf8e84f"),
        ("_get_peer_stub", "(self, peer)", "10b0cb6b53b45c03"),
        ("should_delay_results", "(self, peer_id)", "ac2cc9887a848eb2"),
    ),
    *_of(
        _CONTAINER,
        "exact_allreduce.ExactAllReduceRunner",
        (
            "__init__",
            "(self, tensors, peer_fractions, compression=<NoCompression>, part_size_bytes=524288, "
            "tensor_infos=None, return_deltas=True, prefetch=1)",
            "8855c21690c1693f",
        ),
        ("register_failed_reducer", "(self, peer_index)", "bda35c0ca448191b"),
        ("register_processed_part", "(self, peer_index, part_index, part)", "65ad532d1a19ad03"),
    ),
    *_of(
        _REDUCER,
        "reducer.SenderlessEndingReducer",
        ("finalize", "(self)", "20c165fc55f34b93"),
    ),
    *_of(
        _DHT,
        "state_relay.UploadServer",
        ("_get_p2p_daemon_listen_maddr", "(_dht, node)", "f00cfac62deb8dcd"),
    ),
    *_of(
        "hivemind.utils.mpfuture.MPFuture",
        "diloco.tools.warm_start.own_hivemind_locks",
        ("reset_backend", "()", "4b0b643e648dc5b2"),
    ),
)

# attributes of hivemind's objects we read or set: each must still be set in its class (or a base)
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    _AVERAGER: (
        "_averaged_tensors", "_matchmaking", "_outer_pipe", "_p2p", "_parent_pid", "_pending_groups_registered",
        "_running_groups", "_state_updated", "allow_state_sharing", "dht", "lock_averaged_tensors",
        "next_chunk_timeout", "peer_id", "prefix", "request_timeout", "schema_hash", "serializer",
        "state_sharing_priority",
    ),
    "hivemind.averaging.matchmaking.Matchmaking": (
        "assembled_group", "current_leader", "group_key_manager", "potential_leaders", "target_group_size",
    ),
    "hivemind.averaging.key_manager.GroupKeyManager": ("group_bits", "prefix", "target_group_size"),
    "hivemind.averaging.matchmaking.PotentialLeaders": ("target_group_size",),
    _RUNNER: (
        "active_senders", "all_senders_started", "group_id", "modes", "ordered_peer_ids", "parts_for_local_averaging",
        "peer_id", "reducer_timeout", "sender_peer_ids", "tensor_part_container", "tensor_part_reducer", "weight",
    ),
    _CONTAINER: (
        "_input_parts_by_peer", "_inputs_consumed_by_peer", "failed_size", "num_parts_by_peer", "prefetch",
        "return_deltas",
    ),
    _REDUCER: (
        "accumulator", "current_part_accumulated_from", "current_part_future", "current_part_index", "denominator",
        "finished", "num_current_senders", "num_parts", "num_parts_received", "num_senders", "part_shapes",
        "sender_failed_after",
    ),
    "hivemind.utils.asyncio._AsyncContextWrapper": ("EXECUTOR_LOCK",),
}  # fmt: skip


def resolve(dotted: str) -> object:
    """The object a dotted path names: a module's attribute, or an attribute of one, and so on."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    raise ImportError(f"no module in {dotted}")


def _function(owner: type, name: str):
    """The function ``owner`` defines as ``name`` (a property's getter; a static or class method's function)."""
    found = inspect.getattr_static(owner, name)
    if isinstance(found, property):
        return found.fget
    return getattr(found, "__func__", found)


def fingerprint(function) -> str:
    """A digest of ``function``'s code (``source_fingerprint`` of its source)."""
    return source_fingerprint(inspect.getsource(function))


def source_fingerprint(source: str) -> str:
    """A digest of the code of the function ``source`` defines: parsed, its docstring dropped,
    written back (so comments, docstrings and layout do not count)."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        node.body = node.body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]


def signature(function) -> str:
    """``function``'s parameters as text: names, kinds and defaults (a default that is not a plain
    value by its type's name); annotations are left to the fingerprint."""
    parameters = []
    for parameter in inspect.signature(function).parameters.values():
        default = parameter.default
        if default is not inspect.Parameter.empty and not isinstance(default, int | float | str | bytes | None):
            default = _Named(type(default).__name__)
        parameters.append(parameter.replace(annotation=inspect.Parameter.empty, default=default))
    return str(inspect.Signature(parameters))


class _Named:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def now(owner: str, name: str) -> tuple[str, str]:
    """(signature, fingerprint) of hivemind's ``owner.name`` as installed."""
    function = _function(resolve(owner), name)
    return signature(function), fingerprint(function)


def differences(pinned: Pinned) -> list[str]:
    """What differs in the installed hivemind from the pinned version of one method: nothing when
    it is the same; one line each for its signature and its code (naming the method and ``ours``)."""
    try:
        installed, digest = now(pinned.owner, pinned.name)
    except (ImportError, AttributeError) as error:
        return [f"{pinned.where} (overridden or relied on by {pinned.ours}) is gone: {error}"]
    found = []
    if installed != pinned.signature:
        found.append(f"{pinned.where} (for {pinned.ours}): signature is now {installed}, was {pinned.signature}")
    if digest != pinned.fingerprint:
        found.append(
            f"{pinned.where} (for {pinned.ours}): its code changed (fingerprint {digest}, was {pinned.fingerprint})"
        )
    return found


def set_attributes(owner: type) -> set[str]:
    """The attributes ``owner`` (a class) or its bases set on ``self`` or define (methods, class
    attributes, properties), as their source says."""
    names = set()
    for cls in owner.__mro__:
        if cls is object:
            continue
        names |= set(vars(cls))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):  # a class without source (a builtin)
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
                names.add(node.attr)
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def missing_attributes() -> list[str]:
    """One line per attribute in ``ATTRIBUTES`` that its hivemind class no longer sets."""
    found = []
    for owner, names in ATTRIBUTES.items():
        have = set_attributes(resolve(owner))
        found += [f"{owner}.{name}: no longer set by hivemind" for name in names if name not in have]
    return found


_warned = False


def warn_if_not_pinned() -> None:
    """One warning line per process when the installed hivemind is not the pinned version."""
    global _warned
    import hivemind

    if hivemind.__version__ != PINNED and not _warned:
        _warned = True
        logger.warning(
            "hivemind %s is installed; diloco overrides parts of hivemind %s (diloco/comm/hivemind/overrides.py)",
            hivemind.__version__,
            PINNED,
        )


def _print_table() -> None:
    """The tables' entries as the installed hivemind has them (to record a checked upgrade)."""
    names = {value: name for name, value in globals().items() if name.isupper() and isinstance(value, str)}
    for title, table in (("OVERRIDDEN", OVERRIDDEN), ("RELIED_ON", RELIED_ON)):
        print(f"{title} = (")
        for (owner, ours), group in itertools.groupby(table, key=lambda pinned: (pinned.owner, pinned.ours)):
            print(f"    *_of(\n        {names.get(owner, repr(owner))},\n        {ours!r},")
            for pinned in group:
                installed, digest = now(pinned.owner, pinned.name)
                line = f"        ({pinned.name!r}, {installed!r}, {digest!r}),"
                if len(line) > 120:
                    wrapped = textwrap.wrap(installed, 96, drop_whitespace=False)
                    text = "".join(f"\n            {part!r}" for part in wrapped)
                    line = f"        (\n            {pinned.name!r},{text},\n            {digest!r},\n        ),"
                print(line)
            print("    ),")
        print(")")


if __name__ == "__main__":
    _print_table()
