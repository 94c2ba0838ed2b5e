"""The one error type of the layer store."""

from mtjax.errors import MtjaxError


class StoreError(MtjaxError, ValueError):
    """A store that cannot be used as asked; the message names the store and what to do.

    Raising it never leaves the store's committed step damaged.
    """
