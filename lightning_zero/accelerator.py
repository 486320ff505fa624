"""``lightning_zero.accelerator``: DeepSpeed's ``deepspeed.accelerator.get_accelerator()`` for the scripts that use it
(``get_accelerator().device_name()``, ``.communication_backend_name()``, ...), on CUDA when it is there, else the CPU."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

__all__ = ["get_accelerator", "Accelerator"]


class Accelerator:
    """The subset of DeepSpeed's accelerator interface training scripts call."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    def device_name(self, device_index: Optional[int] = None) -> str:
        return self._name if device_index is None or not self._cuda else f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds CUDA's generators too

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        if not self._cuda:
            raise RuntimeError("get_accelerator().Stream() needs CUDA: this process has no GPU.")
        return torch.cuda.Stream(*args, **kwargs)

    def Event(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        if not self._cuda:
            raise RuntimeError("get_accelerator().Event() needs CUDA: this process has no GPU.")
        return torch.cuda.Event(*args, **kwargs)

    def __getattr__(self, name: str) -> Union[Any, None]:
        raise AttributeError(f"get_accelerator().{name} is not provided by lightning_zero.accelerator; call torch "
                             f"directly (torch.cuda.{name} on a GPU).")


_accelerator: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator()
    return _accelerator
