"""The model, optimizer and batches of the multi-process tests (tests/test_hosts.py and
the processes it spawns, tests/hosts_worker.py): small, and every step clipped."""

import dataclasses

import numpy as np

from mtjax.lora import LoraConfig
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig

# Odd row counts (97, 33) so that the two processes' shares of a leaf differ by a row.
CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=33, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
OPT = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2, decay_steps=10, clip_norm=0.05, weight_decay=0.1)
STEPS = 5
# Frozen leaves (mtjax.roles) on two processes: freeze patterns with every kind of state
# on disk, LoRA adapters with it in RAM ({case: (config, tier)}, 2 micro-batches each).
FROZEN = {"freeze-disk": (dataclasses.replace(CFG, freeze=("embed", "block.*/mlp.*",
                                                            "block.1/self_attn.v_proj.kernel")), "disk"),
          "lora-ram": (dataclasses.replace(CFG, lora=LoraConfig(rank=4, alpha=8.0,
                                                                 target_modules=("q_proj", "v_proj", "down_proj"))),
                       "ram")}
FROZEN_ACCUM = 2

# For the resident memory each process's state takes: its master weights and AdamW state
# (12 bytes a parameter, half of them on each of two processes) dominate the compute copy
# (bfloat16, whole on every process: 2 bytes a parameter), ~17M parameters, nearly all in
# the embedding and the head (one block: one more compile only when stepped, which it is not).
BIG = ModelConfig(vocab_size=32768, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, compute_dtype="bfloat16")


def batches(accum: int, rows: int = 4, seed: int = 0):
    """Every step's global batch: 4 rows, one on each device of two processes of two."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, (accum, rows, 16), dtype=np.int32) for _ in range(STEPS)]
