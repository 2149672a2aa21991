"""``agentenv.devices``: a device as a user names it, checked by spelling (without torch) and
resolved to a ``torch.device`` this machine has, or refused naming the option and the fix."""

from __future__ import annotations

import pytest
import torch

from agentenv.devices import DEVICE, DEVICE_NAMES, check_device, resolve_device
from agentenv.errors import ConfigError

HERE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.mark.parametrize("name, ok", [("auto", True), ("cpu", True), ("cuda", True), ("cuda:0", True),
                                      ("cuda:12", True), ("gpu", False), ("CPU", False), ("cuda:", False),
                                      ("cuda:x", False), ("cuda:0 ", False), ("mps", False), (0, False)])
def test_the_spelling_check_takes_the_four_forms_only(name, ok):
    assert DEVICE(name) is ok
    assert DEVICE.says == "must be auto, cpu, cuda or cuda:N" == f"must be {DEVICE_NAMES}"


def test_auto_and_cpu_resolve_on_any_machine_and_a_misspelling_is_refused_naming_the_option():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == resolve_device() == HERE
    check_device("cpu")
    check_device("auto")
    with pytest.raises(ConfigError, match="^device must be auto, cpu, cuda or cuda:N, got 'gpu'$"):
        resolve_device("gpu")
    with pytest.raises(ConfigError, match="^policy_device must be auto, cpu, cuda or cuda:N, got 'cuda:one'$"):
        check_device("cuda:one", what="policy_device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_where_there_is_none_is_refused_with_what_to_use_instead_and_cuda_left_alone():
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"^engine_device='{name}': torch sees no CUDA device here \(torch .*, "
                                              r"torch.cuda.is_available\(\) is False\); use engine_device='cpu', or "
                                              r"engine_device='auto' to take a GPU only where there is one$"):
            resolve_device(name, what="engine_device")
    assert not torch.cuda.is_initialized()  # a process that starts vLLM afterwards may still fork


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_index_this_machine_lacks_is_refused_naming_the_ones_it_has():
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"device='cuda:{count}': this machine has {count} CUDA device\(s\), "
                                          rf"cuda:0 to cuda:{count - 1}"):
        check_device(f"cuda:{count}")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
