"""The device the torch reference emulates: DeepGEMM's `get_num_sms` / `set_num_sms`.

Its SM count is the CUDA device's when torch sees one, else contracts.DEFAULT_NUM_SMS (an
H200), unless set: the schedule metadata and the paged logits check it as DeepGEMM does.
"""

from __future__ import annotations

import torch

from jax_dg import contracts

__all__ = ["get_num_sms", "set_num_sms"]

_num_sms: int | None = None


def set_num_sms(num_sms: int | None) -> None:
    """Overrides the emulated SM count (None: back to the default)."""
    global _num_sms
    _num_sms = None if num_sms is None else int(num_sms)


def get_num_sms() -> int:
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return contracts.DEFAULT_NUM_SMS
