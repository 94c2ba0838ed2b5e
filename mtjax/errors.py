"""Errors a user can act on. The command line prints their message as one line."""

from mtjax.partid import PartId


class MtjaxError(Exception):
    """Base of every error caused by input (config, checkpoint, data, disk state)."""


class NonFiniteStep(MtjaxError):
    """A step's loss or gradients were NaN or Inf; its update was not applied.

    `parts` names the parts whose gradients went non-finite, in the order the backward
    pass produced them (head first, then blocks from the last to the first, then embed).
    """

    def __init__(self, step: int, loss: float, parts: list[PartId]):
        self.step, self.loss, self.parts = step, loss, list(parts)
        blocks = [p for p in self.parts if PartId(p).is_block]
        where = (f"first block with non-finite gradients: {blocks[0]} (of {', '.join(self.parts)})" if blocks
                 else f"non-finite gradients in: {', '.join(self.parts)}" if self.parts else "gradients finite")
        super().__init__(f"step {step}: loss {loss} or gradients are not finite ({where}); no state was changed. "
                         "Lower optim.lr, check the data, or set run.on_nonfinite=skip to skip such steps")


class MissingPackage(MtjaxError):
    """A feature needs a package that is not installed (an optional one, or one an
    environment such as a GPU image lacks)."""

    def __init__(self, feature: str, package: str, extra: str | None = None):
        self.package = package
        hint = f"pip install {package}" + (f" (or install mtjax with the [{extra}] extra)" if extra else "")
        super().__init__(f"{feature} needs the {package} package, which is not installed: {hint}")
