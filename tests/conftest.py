import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
