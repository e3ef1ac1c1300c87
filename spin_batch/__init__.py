"""spin-batch: offline batch LLM inference with SPIN speculative decoding."""

__version__ = "0.2.1"
