"""The bundled tiny models and the code that builds them, and quiet model loading.

Two models ship with the package, each a ~1.7M-parameter Qwen2-architecture model trained on
CPU by the project's own scripts on ``retool-math`` transcripts:

* ``tiny-retool`` (the default): ReTool calls, ``<code>...</code>`` answered by
  ``<interpreter>...</interpreter>`` (:mod:`agentenv.recipes.tiny`);
* ``tiny-hermes``: thinks in ``<think>...</think>``, calls ``<tool_call>{json}</tool_call>``
  and reads ``<tool_response>`` turns under its Qwen-style chat template; use it with
  ``retool-math``'s ``format="hermes"`` (:mod:`agentenv.recipes.tiny_hermes`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TINY_MODEL_DIR = Path(__file__).with_name("tiny-retool")
#: The bundled models by name (``--model NAME``).
BUNDLED: dict[str, Path] = {"tiny-retool": TINY_MODEL_DIR, "tiny-hermes": Path(__file__).with_name("tiny-hermes")}


def default_model() -> Path:
    """The bundled tiny model's directory (what the CLI uses without ``--model`` when the
    environment pins no tool format: :func:`agentenv.models.native.default_model_for`)."""
    return TINY_MODEL_DIR


def model_dir(model: str | Path | None) -> Path:
    """The directory ``model`` names: None is the default model; a bundled model's name
    (:data:`BUNDLED`) that is not a directory here is that model's directory; anything else is a
    path as given."""
    if model is None:
        return default_model()
    path = Path(model)
    if str(model) in BUNDLED and not path.is_dir():
        return BUNDLED[str(model)]
    return path


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
