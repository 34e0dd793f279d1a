"""Why CPU step times need glibc told to keep freed memory, and the setting that does it."""

from __future__ import annotations

import os
import platform

import torch

# glibc gives large blocks (mmapped ones) back to the OS when freed, so each CPU step touches its large
# activations afresh (page faults, in the kernel's time), and a policy that holds less pays fewer faults. That
# saving hides recompute, which a GPU's caching allocator never shows. No mmap and no trimming keeps freed memory
# in the process. Measured on Llama-3-8B (2 blocks, 512 tokens): 40.8M page faults against 2.7M; full's overhead
# over none read 1.10x without it, 1.21x with it (the roofline predicts 1.25x). Raising the mmap threshold alone
# is not enough: glibc caps it at 32 MiB, and a 128k-vocabulary logits tensor is 250 MiB.
KEEP_FREED = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def allocator_note(device: torch.device) -> str | None:
    """A note for step times measured on ``device``, or None: on a glibc CPU without ``GLIBC_TUNABLES`` setting
    malloc, what the measured ratios hide and the setting that keeps freed memory in the process."""
    if device.type != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    return (
        "note: glibc gives freed memory back to the OS, so each CPU step pays page faults for its fresh "
        "activations, fewer for a policy that holds less: the measured overheads over none read lower than a GPU's "
        f"caching allocator would show them. For those, run again with GLIBC_TUNABLES={KEEP_FREED}"
    )
