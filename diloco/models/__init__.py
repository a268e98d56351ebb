"""The models a worker trains, behind one interface.

- ``gpt.py``  the model config (``model.*``) and a small GPT for tests and demos; ``build_model``
- ``hf.py``   a Hugging Face causal LM (presets, a config.json, local weights) behind GPT's interface
"""
