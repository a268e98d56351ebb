"""What a worker trains on.

- ``corpus.py``       a corpus of tokens (bytes by default), disjoint per-worker shards, the held-out split
- ``hf.py``           a local Hugging Face dataset and tokenizer feeding the corpus's token tensor
- ``token_cache.py``  a dataset streamed once into a memory-mapped token file (corpora larger than memory)
"""
