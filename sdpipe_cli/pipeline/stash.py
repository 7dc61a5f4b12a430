"""Weight stashing: the weight versions a stage keeps for its micro-batches in flight.

In asynchronous 1F1B (PipeDream) a stage updates its weights after every backward, while up to
``S - stage`` micro-batches are between their forward and their backward. Back-propagating a
micro-batch through weights other than the ones its forward used would differentiate a function
that was never evaluated (the saved activations belong to the old weights), so each forward's
weights are kept until that micro-batch's backward, and the gradient computed there is applied
to the *latest* weights (PipeDream's rule; the staleness is ``S - stage - 1`` updates).

A version is a set of detached copies of the stage's parameters, made only when the live weights
changed since the last copy: the micro-batches forwarded between two updates share one (a
reference count), and a version is freed as soon as its last micro-batch went backward. The
caller runs each forward with ``torch.func.functional_call(module, tensors, x)``, so the module
itself is never copied, and its live parameters stay the optimizer's.

Version ids count weight changes in this process: the owner calls :meth:`WeightStash.changed`
after every update (an optimizer step and whatever averaging follows it, or a pull from a
parameter server). The number of versions alive never exceeds the bound given (``S - stage``);
exceeding it means the schedule keeps more in flight than it should, and is an error.

With a bound of 1 (the last stage, whose backward directly follows its forward) no update can
come between a forward and its backward, so the forward uses the live parameters and nothing is
copied, as in PipeDream; :meth:`WeightStash.changed` checks that promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["WeightStash"]


@dataclass
class _Version:
    tensors: dict[str, torch.Tensor]
    users: int  # micro-batches whose backward still needs these weights


class WeightStash:
    """The stashed weight versions of one stage; at most ``bound`` alive at any time."""

    def __init__(self, module: nn.Module, bound: int):
        if bound < 1:
            raise ValueError(f"bound must be >= 1, got {bound}")
        self.module, self.bound = module, bound
        self.version = 0  # id of the live weights
        self._versions: dict[int, _Version] = {}
        self._of: dict[int, int] = {}  # micro-batch in flight -> its version
        self.copies = 0  # versions made (each one copy of the parameters)
        self.peak_versions = 0
        self.peak_bytes = 0

    @property
    def copying(self) -> bool:
        """Whether versions are copies (bound > 1) or the live parameters themselves (bound 1)."""
        return self.bound > 1

    def changed(self) -> None:
        """The live weights changed (update, averaging, pull): the next forward needs a new copy."""
        if not self.copying and self._of:
            raise RuntimeError(f"weights changed while micro-batch(es) {sorted(self._of)} use them "
                               "uncopied (a stash bound of 1 allows no update between a forward "
                               "and its backward)")
        self.version += 1

    def acquire(self, microbatch: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The version for ``microbatch``'s forward: the live weights, copied unless already stashed."""
        if microbatch in self._of:
            raise RuntimeError(f"micro-batch {microbatch} is already in flight")
        entry = self._versions.get(self.version)
        if entry is None:
            if len(self._versions) >= self.bound:
                raise RuntimeError(
                    f"weight stash over its bound: {len(self._versions)} versions alive "
                    f"(micro-batches in flight: {sorted(self._of)}), at most {self.bound}")
            if self.copying:
                tensors = {name: p.detach().clone().requires_grad_(p.requires_grad)
                           for name, p in self.module.named_parameters()}
                self.copies += 1
            else:
                tensors = dict(self.module.named_parameters())
            entry = self._versions[self.version] = _Version(tensors, 0)
            self.peak_versions = max(self.peak_versions, len(self._versions))
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        entry.users += 1
        self._of[microbatch] = self.version
        return self.version, entry.tensors

    def get(self, microbatch: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The version ``microbatch``'s forward used (for its backward)."""
        version = self._of[microbatch]
        return version, self._versions[version].tensors

    def release(self, microbatch: int) -> int:
        """``microbatch``'s backward is done; frees its version once no other micro-batch uses it."""
        version = self._of.pop(microbatch)
        entry = self._versions[version]
        entry.users -= 1
        if entry.users == 0:
            del self._versions[version]
        return version

    @property
    def in_flight(self) -> int:
        return len(self._of)

    @property
    def versions(self) -> int:
        """Versions alive now."""
        return len(self._versions)

    @property
    def bytes(self) -> int:
        """Bytes of the copies alive now (0 when versions are the live parameters)."""
        if not self.copying:
            return 0
        return sum(t.numel() * t.element_size()
                   for v in self._versions.values() for t in v.tensors.values())

    def stats(self) -> dict[str, int]:
        """For the step and done events: the bound, the peaks so far and the copies made."""
        return {"stash_bound": self.bound, "stash_peak_versions": self.peak_versions,
                "stash_peak_bytes": self.peak_bytes, "stash_copies": self.copies}
