"""The model's settings (``model.*``): which model a worker trains and its shape, read by both
model builders (``gpt.py``, ``hf.py``) and by the memory estimates."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_KINDS = ("gpt", "hf")


@dataclass
class ModelConfig:
    kind: str = "gpt"  # gpt: the small built-in GPT (model.n_*) / hf: a Hugging Face causal LM (model.hf_config)
    hf_config: str = ""  # kind=hf: a preset (llama-tiny, llama-150m, llama-1b) or a local config.json / its folder
    hf_weights: str = ""  # kind=hf: a local folder of pretrained weights (save_pretrained); "" = random init
    n_layer: int = 4  # gpt: number of transformer blocks
    n_head: int = 4  # gpt: attention heads per block; must divide n_embd
    n_embd: int = 128  # gpt: width of the residual stream
    block_size: int = 64  # tokens per training sequence (and, for gpt, the longest context)
    dropout: float = 0.0  # gpt: dropout probability in attention, MLP and embeddings; 0 disables it
    bias: bool = True  # gpt: whether Linear and LayerNorm layers carry a bias
