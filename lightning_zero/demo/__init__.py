"""The model and data of the command-line app (``make train``): a small character-level GPT on a corpus
built from text that ships with Python. Importable as ``lightning_zero.demo.gpt`` / ``lightning_zero.demo.data``."""
