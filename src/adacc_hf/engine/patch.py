"""`ModelPatch`: what a session changes on its model, and how it is undone.

Three things: the runtime's patch (`runtime.apply_adacc`'s handle, which runs a policy), the
planning hook before each training forward (`forward_hook`), and the mark ``OWNER`` in the
model's ``__dict__`` that says which session owns the model (the Trainer callback reads it, so a
second callback on the same model reuses the first one's session).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..policy import Policy
from ..runtime import AdaccHandle, apply_adacc
from .forward_hook import install_planning_hook

__all__ = ["OWNER", "ModelPatch", "owner_of"]

OWNER = "_adacc_session"  # the model's __dict__ key naming the session that patched it


def owner_of(model: nn.Module) -> Any:
    """The session that owns `model` (an unwrapped model), or None."""
    return model.__dict__.get(OWNER)


class ModelPatch:
    """The runtime handle, the planning hook and the owner mark of one session on its model.

    Args:
        model: the unwrapped model.
        owner: the session (marked on the model while it is patched).
    """

    def __init__(self, model: nn.Module, owner: Any) -> None:
        self.model = model
        self.owner = owner
        self.handle: AdaccHandle | None = None
        self._hook: Any = None

    @property
    def active(self) -> bool:
        """Whether a policy runs on the model now."""
        return self.handle is not None and self.handle.active

    def run(self, policy: Policy, tracker: Any = None, host_cap: int | None = None) -> None:
        """Run `policy` from the next forward on (patching the model the first time).

        Args:
            policy: the policy to run.
            tracker: the rectifier's tracker armed for this step, if any.
            host_cap: bytes of host memory offload may use (None: the default cap).
        """
        self.model.__dict__[OWNER] = self.owner
        if self.active:
            self.handle.set_policy(policy)
        else:
            self.handle = apply_adacc(self.model, policy, host_cap=host_cap or None)
        if tracker is not None:
            self.handle.set_tracker(tracker)

    def set_tracker(self, tracker: Any) -> None:
        """Hand the runtime the rectifier's tracker (None: stop tracking)."""
        if self.handle is not None:
            self.handle.set_tracker(tracker)

    def hook(self) -> None:
        """Install the planning hook (once)."""
        if self._hook is not None:
            return
        self.model.__dict__[OWNER] = self.owner
        self._hook = install_planning_hook(self.owner)

    def remove(self) -> None:
        """Undo everything on the model: the hook, the runtime's patch, the owner mark."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.handle is not None:
            self.handle.set_tracker(None)
            self.handle.remove()
        if owner_of(self.model) is self.owner:
            del self.model.__dict__[OWNER]
