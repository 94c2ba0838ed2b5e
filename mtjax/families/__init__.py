"""Model families: one module each, registered when this package is imported.

    registry   Family (config.json in and out, behaviour switches, checkpoint names) and the table
    hf_config  what the families share to read and write config.json (ConfigError, RopeScaling, ...)

The built-in families: llama, mistral, qwen2, qwen3, phi3, mixtral, qwen_moe (Qwen2-MoE
and Qwen3-MoE), olmoe, gemma (Gemma 2 and 3), llama4,
deepseek (DeepSeek-V2 and V3), gpt_oss, qwen3_5 (Qwen3-Next, Qwen3.5, Qwen3.5-MoE). docs/model.md says how to add one.
"""

# Registered in this order, the order error messages list them in.
from mtjax.families import llama, mistral, qwen2, qwen3, phi3  # noqa: F401, I001
from mtjax.families import gemma, mixtral, qwen_moe, olmoe, llama4, deepseek  # noqa: F401, I001
from mtjax.families import gpt_oss  # noqa: F401, I001
from mtjax.families import qwen3_5  # noqa: F401, I001
from mtjax.families.registry import FAMILIES, Family, get, match, model_types, register, unregister  # noqa: F401
