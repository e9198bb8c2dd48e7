"""Inference-engine (vLLM, SGLang) metrics aligned to training steps."""
