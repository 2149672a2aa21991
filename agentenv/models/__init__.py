"""The bundled tiny model and the code that builds it."""

from pathlib import Path

TINY_MODEL_DIR = Path(__file__).with_name("tiny-retool")


def default_model() -> Path:
    return TINY_MODEL_DIR
