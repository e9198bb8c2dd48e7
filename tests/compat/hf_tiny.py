"""A tiny causal LM and its tokenizer, built here: no download, a few milliseconds of CPU per
step. Shared by the transformers/TRL and accelerate tests."""

from __future__ import annotations

import os
from typing import Any

#: Text the tokenizer learns its merges from (and the prompts are made of).
CORPUS = (
    "the cat sat on the mat",
    "two plus two is four",
    "count to three: one two three",
    "a reward for every step",
)
PROMPTS = ("the cat", "two plus", "count to", "a reward")


def offline(monkeypatch: Any) -> None:
    """Hugging Face libraries never reach the hub."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_", "TENSORBOARD_", "OTEL_")):
            monkeypatch.delenv(name)


def tiny_tokenizer() -> Any:
    """A byte-level BPE trained on :data:`CORPUS`, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def tiny_llama(tokenizer: Any, seed: int = 0) -> Any:
    """A two-layer Llama with a hidden size of 16, initialised from ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
