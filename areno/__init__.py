"""areno: asynchronous RL post-training for LLMs."""

__version__ = "0.1.0"
