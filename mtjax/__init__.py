"""mtjax: train language models far larger than accelerator memory, one block at a time.

The Python API (see README.md for a walk-through):

    import mtjax
    cfg = mtjax.load_hf_config("path/to/checkpoint")          # or ModelConfig(...)
    cfg, params = mtjax.load_params("path/to/checkpoint")     # Hugging Face weights
    logits = mtjax.forward(cfg, params, tokens)               # fp32 [batch, seq, vocab]
    loss = mtjax.loss_fn(cfg, params, tokens)
    params, opt_state, losses = mtjax.train_reference(cfg, params, batches, OptimConfig())
    mtjax.save_params(cfg, params, "out_dir")                 # a Hugging Face checkpoint
"""

import importlib

from mtjax import cpu_pool

cpu_pool.ensure()  # before any mtjax code starts JAX's backend

# The API's names, imported when first used: `import mtjax` (and so the `mtjax` command,
# before it has installed its Ctrl-C handler and checked the environment) imports no JAX.
_API = {
    "CheckpointError": "mtjax.hf", "load_params": "mtjax.hf", "save_params": "mtjax.hf",
    "cross_entropy": "mtjax.loss", "head_loss": "mtjax.loss",
    "abstract_block": "mtjax.model", "abstract_params": "mtjax.model", "forward": "mtjax.model",
    "init_params": "mtjax.model",
    "ConfigError": "mtjax.model_config", "ModelConfig": "mtjax.model_config", "from_hf_dict": "mtjax.model_config",
    "load_hf_config": "mtjax.model_config", "to_hf_dict": "mtjax.model_config",
    "OptimConfig": "mtjax.optim", "make_optimizer": "mtjax.optim",
    "ReferenceTrainer": "mtjax.reference", "loss_fn": "mtjax.reference", "train_reference": "mtjax.reference",
}
_RENAMED = {"train_reference": "train"}


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'mtjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "ModelConfig", "OptimConfig", "ReferenceTrainer",
    "abstract_block", "abstract_params", "cross_entropy", "forward", "head_loss", "from_hf_dict",
    "init_params", "load_hf_config", "load_params", "loss_fn", "make_optimizer",
    "save_params", "to_hf_dict", "train_reference",
]
