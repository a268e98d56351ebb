"""Compression of pseudo-gradients on the wire. ``build_codec`` picks one from ``compression.name``.

- ``codec.py``           ``Codec`` (the interface and the self-describing payload), ``none``, ``fp16``
- ``quantize.py``        ``int8`` and ``int4``: blockwise absmax quantization
- ``topk.py``            ``topk``: chunked top-k with few-bit values
- ``adaptive.py``        ``adaptive``: a codec agreed per round among candidates, to fit the link
- ``error_feedback.py``  ``ErrorFeedback``: the residual a lossy codec carries into the next round

DESIGN.md's ``Compressor`` is split in two: the stateless ``Codec`` that transports run where the
bytes are made (hivemind's averager runs in its own process), and the worker's ``ErrorFeedback``
state, which goes into its checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.compression.adaptive import Adaptive
from diloco.compression.codec import (
    HEADER_BYTES,
    PAYLOAD_FORMAT,
    Codec,
    Float16,
    NoCompression,
    PayloadError,
    all_finite,
)
from diloco.compression.error_feedback import ErrorFeedback
from diloco.compression.quantize import Int4, Int8
from diloco.compression.topk import MEANS, VALUE_BITS, TopK
from diloco.errors import require

CODECS = ("none", "fp16", "int8", "int4", "topk")
ADAPTIVE = "adaptive"  # compression.name: one of compression.adaptive_codecs each round, to fit the link
# top-k is left out by default: at the quality workload it ends ~1.2 x dense DiLoCo's loss, so a
# round it carries costs more loss than a late one (docs/compression.md)
ADAPTIVE_DEFAULT = ("none", "fp16", "int8", "int4")
# adaptive: ``topk`` among the candidates is top-k at these multiples of compression.topk_k (at most
# the chunk), least lossy first: a round too slow for int4 takes as many values as fit its link
TOPK_LADDER = (8, 4, 2, 1)

__all__ = [
    "ADAPTIVE",
    "Adaptive",
    "all_finite",
    "CODECS",
    "HEADER_BYTES",
    "PAYLOAD_FORMAT",
    "Codec",
    "NoCompression",
    "CompressionConfig",
    "ErrorFeedback",
    "PayloadError",
    "build_codec",
]


@dataclass
class CompressionConfig:
    name: str = "none"  # pseudo-gradients on the wire: none (fp32) / fp16 / int8 / int4 / topk / adaptive
    block_size: int = 64  # int8 / int4: values that share one scale
    topk_k: int = 64  # topk: values kept in each chunk (SparseLoCo: 184; adaptive's topk: 8, 4, 2 and 1 x this)
    topk_chunk: int = 4096  # topk: chunk length (at most 65536)
    topk_value_bits: int = 2  # topk: bits a kept value (1, 2, 4 or 8; 1: its sign times the chunk's mean magnitude)
    topk_mean: str = "all"  # topk: gathered values averaged over all workers / over the senders of each (SparseLoCo)
    error_feedback: bool = True  # lossy codecs: carry what was not sent into the next round (one fp32 copy of params)
    error_decay: float = 1.0  # error feedback: what is carried over is multiplied by this each round (SparseLoCo: 0.85)
    adaptive_codecs: list[str] = field(default_factory=lambda: list(ADAPTIVE_DEFAULT))  # adaptive: least lossy first
    comm_budget: float = 0.1  # adaptive: a round's transfer may take this share of the time between rounds


def validate_compression_config(cfg: CompressionConfig) -> None:
    """Raise ``ConfigError`` naming the ``compression.*`` setting to change."""
    names = (*CODECS, ADAPTIVE)
    require(cfg.name in names, f"compression.name={cfg.name!r} is not one of {', '.join(names)}")
    if cfg.name == ADAPTIVE:
        candidates = list(cfg.adaptive_codecs)
        require(candidates, "compression.adaptive_codecs is empty: name at least one codec")
        for name in candidates:
            require(name in CODECS, f"compression.adaptive_codecs: {name!r} is not one of {', '.join(CODECS)}")
        require(len(set(candidates)) == len(candidates), "compression.adaptive_codecs names a codec twice")
        require(
            candidates == sorted(candidates, key=CODECS.index),
            f"compression.adaptive_codecs={candidates} must run from least to most lossy, "
            f"in the order {', '.join(CODECS)}",
        )
        require(cfg.comm_budget > 0, f"compression.comm_budget={cfg.comm_budget} must be above 0")
    require(cfg.block_size >= 1, f"compression.block_size={cfg.block_size} must be at least 1")
    require(1 <= cfg.topk_chunk <= 65536, f"compression.topk_chunk={cfg.topk_chunk} must be in [1, 65536]")
    require(
        1 <= cfg.topk_k <= cfg.topk_chunk,
        f"compression.topk_k={cfg.topk_k} must be in [1, compression.topk_chunk]",
    )
    require(
        cfg.topk_value_bits in VALUE_BITS,
        f"compression.topk_value_bits={cfg.topk_value_bits} is not one of {', '.join(map(str, VALUE_BITS))}",
    )
    require(cfg.topk_mean in MEANS, f"compression.topk_mean={cfg.topk_mean!r} is not one of {', '.join(MEANS)}")
    require(0 <= cfg.error_decay <= 1, f"compression.error_decay={cfg.error_decay} must be in [0, 1]")


def build_codec(cfg: CompressionConfig) -> Codec:
    """The codec named by ``cfg.name``; raises ``ConfigError`` naming the key to fix."""
    validate_compression_config(cfg)
    if cfg.name == ADAPTIVE:
        candidates = [codec for name in cfg.adaptive_codecs for codec in _candidates(cfg, name)]
        return Adaptive(candidates, budget=cfg.comm_budget)
    return _build_one(cfg, cfg.name)


def _candidates(cfg: CompressionConfig, name: str) -> list[Codec]:
    """What ``name`` in ``compression.adaptive_codecs`` stands for: the codec, or for ``topk`` the
    top-k ladder (``TOPK_LADDER`` x ``topk_k``, within the chunk), most values first."""
    if name != "topk":
        return [_build_one(cfg, name)]
    ks = sorted({min(cfg.topk_chunk, cfg.topk_k * factor) for factor in TOPK_LADDER}, reverse=True)
    return [TopK(k, cfg.topk_chunk, cfg.topk_value_bits, cfg.topk_mean) for k in ks]


def _build_one(cfg: CompressionConfig, name: str) -> Codec:
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16()
    if name == "int8":
        return Int8(cfg.block_size)
    if name == "int4":
        return Int4(cfg.block_size)
    if name == "topk":
        return TopK(cfg.topk_k, cfg.topk_chunk, cfg.topk_value_bits, cfg.topk_mean)
    raise ValueError(f"compression.name={name!r} is not one of {', '.join(CODECS)}")
