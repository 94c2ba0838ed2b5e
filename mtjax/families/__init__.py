"""Model families: one module each, registered when this package is imported.

    registry   Family (config.json in and out, behaviour switches, checkpoint names) and the table
    hf_config  what the families share to read and write config.json (ConfigError, RopeScaling, ...)

The built-in families: llama, mistral, qwen2, qwen3, phi3, mixtral, qwen_moe (Qwen2-MoE
and Qwen3-MoE), olmoe, gemma (Gemma 2 and 3), llama4. docs/model.md says how to add one.
"""

from mtjax.families import gemma, llama, llama4, mistral, mixtral, olmoe, phi3, qwen2, qwen3, qwen_moe  # noqa: F401
from mtjax.families.registry import FAMILIES, Family, get, match, model_types, register, unregister  # noqa: F401
