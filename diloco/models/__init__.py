"""The models a worker trains, behind one interface.

- ``config.py``  the model's settings (``model.*``, ``ModelConfig``), read by both builders
- ``gpt.py``     a small GPT for tests and demos; ``build_model``, which builds either
- ``hf.py``      a Hugging Face causal LM (presets, a config.json, local weights) behind GPT's interface
"""
