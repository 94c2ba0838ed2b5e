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

from mtjax import cpu_pool

cpu_pool.ensure()  # before any mtjax code starts JAX's backend

from mtjax.hf import CheckpointError, load_params, save_params  # noqa: I001 (after cpu_pool.ensure)
from mtjax.loss import cross_entropy
from mtjax.model import abstract_block, abstract_params, forward, init_params
from mtjax.model_config import ConfigError, ModelConfig, from_hf_dict, load_hf_config, to_hf_dict
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer, loss_fn
from mtjax.reference import train as train_reference

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "ModelConfig", "OptimConfig", "ReferenceTrainer",
    "abstract_block", "abstract_params", "cross_entropy", "forward", "from_hf_dict",
    "init_params", "load_hf_config", "load_params", "loss_fn", "make_optimizer",
    "save_params", "to_hf_dict", "train_reference",
]
