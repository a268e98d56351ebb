"""Hugging Face causal LMs behind the interface the rest of diloco calls: ``model(idx, targets)``
returns ``(logits, loss)``, exactly like :class:`diloco.models.gpt.GPT`.

``model.kind=hf`` picks this path. ``model.hf_config`` names a preset below or a local
``config.json`` (or a directory holding one); the model is built with random init from it
(``AutoModelForCausalLM.from_config``), its vocabulary set to the data's (the tokenizer's, or 256
byte-level tokens). ``model.hf_weights`` instead loads local pretrained weights and their own
config. Nothing is downloaded: transformers is imported only here, and only local files are read.

Usage::

    model = build_hf_model(ModelConfig(kind="hf", hf_config="llama-tiny"), vocab_size=256)
    logits, loss = model(x, targets=y)  # x, y: int64 [batch, time]
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from diloco.errors import ConfigError
from diloco.models.config import ModelConfig
from diloco.optional_deps import import_hf

logger = logging.getLogger(__name__)

_LLAMA = {"model_type": "llama", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "use_cache": False}
# Sizes comparable with OpenDiLoCo's (arXiv:2407.07852) 150M and 1.1B Llama runs; "150m" and
# "1b" count the transformer blocks (the embeddings add 2 x vocab x width on top).
HF_PRESETS: dict[str, dict] = {
    # for tests: 2 blocks of width 64, 82K parameters in the blocks
    "llama-tiny": {
        **_LLAMA,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1024,
    },
    # 12 blocks x (4 x 1024^2 attention + 3 x 1024 x 2688 MLP) = 149.4M
    "llama-150m": {
        **_LLAMA,
        "hidden_size": 1024,
        "intermediate_size": 2688,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 2048,
    },
    # TinyLlama's shape: 22 blocks x (9.4M attention with 4 key/value heads + 34.6M MLP) = 969.0M
    "llama-1b": {
        **_LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
}


def read_hf_config(cfg: ModelConfig) -> dict:
    """The model's config as a plain dict (a preset, ``model.hf_config``'s JSON, or the one beside
    ``model.hf_weights``), read without transformers. Raises ``ValueError`` naming the key."""
    if cfg.hf_weights:
        key, value, path = "model.hf_weights", cfg.hf_weights, Path(cfg.hf_weights).expanduser()
        if not path.is_dir():
            raise ValueError(f"{key}={value!r} is not a directory (a model saved with save_pretrained)")
    elif cfg.hf_config in HF_PRESETS:
        return dict(HF_PRESETS[cfg.hf_config])
    else:
        key, value, path = "model.hf_config", cfg.hf_config, Path(cfg.hf_config).expanduser()
        if not path.exists():
            looks_like_a_name = "/" not in value and not value.endswith(".json")
            what = f"is not a preset ({', '.join(HF_PRESETS)})" if looks_like_a_name else "does not exist"
            raise ValueError(f"{key}={value!r} {what}")
    config_file = path / "config.json" if path.is_dir() else path
    try:
        loaded = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{key}={value!r}: {config_file} does not exist") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{key}={value!r}: {config_file} is not a JSON config ({error})") from None
    if not isinstance(loaded, dict) or "model_type" not in loaded:
        raise ValueError(f"{key}={value!r}: {config_file} has no model_type (a transformers config.json has one)")
    return loaded


def validate_hf_model_config(cfg: ModelConfig) -> None:
    """The ``model.hf_*`` settings of a ``model.kind=hf`` config; ``ValueError`` naming the key."""
    if bool(cfg.hf_config) == bool(cfg.hf_weights):
        raise ValueError(
            "model.kind=hf needs one of model.hf_config (a preset: "
            f"{', '.join(HF_PRESETS)}; or a config.json) or model.hf_weights (a saved model directory)"
        )
    context = read_hf_config(cfg).get("max_position_embeddings")
    if context is not None and cfg.block_size > context:
        raise ValueError(f"model.block_size={cfg.block_size} exceeds the model's max_position_embeddings={context}")


class HFCausalLM(nn.Module):
    """A transformers causal LM with GPT's ``forward(idx, targets) -> (logits, loss)``.

    ``targets`` are already shifted (the data pipeline's ``y`` is ``x`` moved left by one), so the
    loss is computed here rather than by passing ``labels``, which transformers would shift again.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
        return logits, loss


def build_hf_model(cfg: ModelConfig, *, vocab_size: int) -> HFCausalLM:
    """Random init from the config with the data's ``vocab_size``, or the local pretrained weights."""

    transformers = import_hf("transformers", needed_for="model.kind=hf", error=ConfigError)
    transformers.utils.logging.disable_progress_bar()
    if cfg.hf_weights:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(cfg.hf_weights, local_files_only=True)
        hf_model.train()  # from_pretrained returns eval mode; GPT starts in train mode
        if hf_model.config.vocab_size < vocab_size:
            raise ConfigError(
                f"model.hf_weights={cfg.hf_weights!r} has {hf_model.config.vocab_size} token ids, fewer than "
                f"the data's {vocab_size}: use the tokenizer the weights were trained with (data.tokenizer)"
            )
    else:
        settings = {**read_hf_config(cfg), "vocab_size": vocab_size}
        hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**settings))
    model = HFCausalLM(hf_model)
    logger.info(
        "model: %s (%s), vocabulary %d -> %.2fM parameters",
        type(hf_model).__name__,
        cfg.hf_weights or cfg.hf_config,
        vocab_size,
        model.num_parameters() / 1e6,
    )
    return model
