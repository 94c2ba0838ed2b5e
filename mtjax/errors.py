"""Errors a user can act on. The command line prints their message as one line."""


class MtjaxError(Exception):
    """Base of every error caused by input (config, checkpoint, data, disk state)."""
