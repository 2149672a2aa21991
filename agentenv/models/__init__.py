"""The bundled tiny model and the code that builds it, and quiet model loading."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TINY_MODEL_DIR = Path(__file__).with_name("tiny-retool")


def default_model() -> Path:
    """The bundled tiny model's directory (what the CLI uses without ``--model``)."""
    return TINY_MODEL_DIR


@contextmanager
def quiet_loading() -> Iterator[None]:
    """No transformers progress bars ("Loading weights") while loading, in library use too;
    the caller's setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
