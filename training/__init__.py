"""Training scripts built on transformers' Trainer: offline data, tokenizers and the demo job.

- `training.data`: the embedded Wikipedia corpus (from gensim's test data) as clean text splits.
- `training.tokenizer`: a byte-level BPE trained on the train split, and GPT-2's BPE from local files.
- `training.demo`: the main job (`python -m training.demo`, `make demo`).
"""
