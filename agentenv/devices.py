"""Where tensors live: a device as a user names it (``"auto"``, ``"cpu"``, ``"cuda"``,
``"cuda:N"``) turned into a ``torch.device`` this machine has.

    device = resolve_device("auto")   # cuda:0 where a CUDA GPU is visible, else cpu

The trainer's policy (``agentenv.train.policy``) and the embedded engine take the same names.
This module imports torch only when it resolves a name, so configs can check a name's spelling
(:data:`DEVICE`) without loading torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .errors import ConfigError
from .options import Check

if TYPE_CHECKING:
    import torch

#: The names a device option takes, in words.
DEVICE_NAMES = "auto, cpu, cuda or cuda:N"
_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")

#: An option's check: the value is one of :data:`DEVICE_NAMES` (spelling only; whether this
#: machine has the device is :func:`resolve_device`'s question).
DEVICE = Check(lambda v: isinstance(v, str) and _NAME.fullmatch(v) is not None, f"must be {DEVICE_NAMES}")


def check_device(name: str, *, what: str = "device") -> None:
    """Refuse ``name`` as :func:`resolve_device` would (a :class:`~agentenv.errors.ConfigError`
    naming ``what=name`` and the fix), without initialising CUDA: a process that starts vLLM
    afterwards keeps forking its engine processes, which CUDA once initialised forbids."""
    import torch

    if not DEVICE(name):
        raise ConfigError(f"{what} must be {DEVICE_NAMES}, got {name!r}")
    if name in ("cpu", "auto"):
        return
    count = torch.cuda.device_count()  # reads the driver; does not initialise CUDA
    if count == 0:
        raise ConfigError(f"{what}={name!r}: torch sees no CUDA device here (torch {torch.__version__}, "
                          f"torch.cuda.is_available() is False); use {what}='cpu', or {what}='auto' to take a "
                          "GPU only where there is one")
    if ":" in name and int(name.split(":")[1]) >= count:
        raise ConfigError(f"{what}={name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def resolve_device(name: str = "auto", *, what: str = "device") -> "torch.device":
    """``name`` as a ``torch.device`` of this machine: ``"auto"`` is the current CUDA device
    where torch sees one, else the CPU; ``"cuda"`` is the current CUDA device. A CUDA device
    this machine lacks is a :class:`~agentenv.errors.ConfigError` naming ``what=name`` and the
    fix (:func:`check_device`)."""
    import torch

    check_device(name, what=what)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = torch.cuda.current_device() if name in ("auto", "cuda") else int(name.split(":")[1])
    return torch.device("cuda", index)


__all__ = ["DEVICE", "DEVICE_NAMES", "check_device", "resolve_device"]
